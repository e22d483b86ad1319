"""The kopf operator: thin adapters that turn cluster state into scheduler input and plans into objects."""

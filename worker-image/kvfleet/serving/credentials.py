"""The pool's two secrets as a worker or the router holds them, kept current while the Secret rotates.

Each pool has one Secret (`<pool>-token`, made by the operator): `token` guards the HTTP endpoints
under /internal (bearer), `migration-key` keys the migration port's HMAC handshake
(kvfleet.worker.migration.transport). A person rotates both by deleting the Secret; the operator makes
a new one with fresh values at its next epoch. Pods start with the values in their environment
(secretKeyRef) and then re-read the Secret through the API: every `refresh_s`, and at once (at most
once per `miss_refresh_s`) when a peer presents a value this pod does not know, which is how a pod
learns of a rotation the moment a faster peer uses it.

Pods do not all learn of a rotation at the same moment, so for `grace_s` after it a pod accepts the
values it held before as well as the new ones: a peer still sending the old token is not refused,
and no stream or migration breaks while the pool turns over. Senders always send the newest value
they know. Nothing here logs a value: only that a rotation happened.

Pure: the reading is injected (`SecretReader`; kvfleet.api.pool_secret reads a Secret with the
Kubernetes client), so the serving contract stays free of the cluster.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

TOKEN_KEY = "token"
MIGRATION_KEY_KEY = "migration-key"
# Where the operator's pod spec puts them (kvfleet.operator.resources).
TOKEN_ENV = "KVFLEET_POOL_TOKEN"
MIGRATION_KEY_ENV = "KVFLEET_MIGRATION_KEY"
SECRET_ENV = "KVFLEET_POOL_SECRET"
# Long enough for every pod of a pool to re-read the Secret (REFRESH_S) after a rotation.
ROTATION_GRACE_S = 300.0
REFRESH_S = 30.0
# An unknown value makes a pod re-read the Secret at most this often: a peer presenting a wrong token
# again and again costs the API server one read a second, not one per attempt.
MISS_REFRESH_S = 1.0


@dataclass(frozen=True)
class PoolSecrets:
    """One generation of the pool's secrets."""

    token: str
    migration_key: bytes

    def __post_init__(self) -> None:
        if not self.token or not self.migration_key:
            raise ValueError("the pool token and the migration key must not be empty")

    def __repr__(self) -> str:  # never print a secret, even by accident
        return "PoolSecrets(<redacted>)"

    @classmethod
    def from_data(cls, data: Mapping[str, str]) -> PoolSecrets:
        """From a Secret's decoded data; a Secret from a release before the migration key had its own
        entry keys the handshake with the token."""
        token = data.get(TOKEN_KEY, "")
        return cls(token, (data.get(MIGRATION_KEY_KEY) or token).encode())


# Reads the pool's Secret now: its decoded data, or None when it does not exist (deleted, not yet remade).
SecretReader = Callable[[], Awaitable[Mapping[str, str] | None]]


class PoolCredentials:
    """The current secrets, the previous ones within their grace period, and the way to refresh them."""

    def __init__(self, current: PoolSecrets, read: SecretReader | None = None, *, grace_s: float = ROTATION_GRACE_S,
                 refresh_s: float = REFRESH_S, miss_refresh_s: float = MISS_REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._current = current
        self._previous: PoolSecrets | None = None
        self._previous_until_s = float("-inf")
        self._read = read
        self.grace_s, self.refresh_s, self.miss_refresh_s = grace_s, refresh_s, miss_refresh_s
        self._clock = clock
        self._last_miss_refresh_s = float("-inf")
        self._lock = asyncio.Lock()
        self.rotations = 0

    @classmethod
    def of(cls, token: str | None, migration_key: str | None = None,
           read: SecretReader | None = None) -> PoolCredentials | None:
        """From the values a pod starts with; None without a token (no internal endpoints, no migrations)."""
        if not token:
            return None
        return cls(PoolSecrets.from_data({TOKEN_KEY: token, MIGRATION_KEY_KEY: migration_key or ""}), read)

    @classmethod
    def from_env(cls, environ: Mapping[str, str],
                 reader: Callable[[str, str], SecretReader]) -> PoolCredentials | None:
        """A pod's: the values the operator's pod spec puts in its environment (`TOKEN_ENV`,
        `MIGRATION_KEY_ENV`), re-read later from the Secret `SECRET_ENV` names in `POD_NAMESPACE` with
        `reader(namespace, name)` (the Kubernetes client's, kvfleet.api.incluster.SecretReader)."""
        secret, namespace = environ.get(SECRET_ENV), environ.get("POD_NAMESPACE")
        read = reader(namespace, secret) if secret and namespace and environ.get(TOKEN_ENV) else None
        return cls.of(environ.get(TOKEN_ENV), environ.get(MIGRATION_KEY_ENV), read)

    # -------------------------------------------------------------------------------- what is valid

    @property
    def token(self) -> str:
        """The token to send."""
        return self._current.token

    @property
    def migration_key(self) -> bytes:
        """The key to prove with when this pod opens a migration connection."""
        return self._current.migration_key

    def _generations(self) -> tuple[PoolSecrets, ...]:
        if self._previous is not None and self._clock() < self._previous_until_s:
            return self._current, self._previous
        return (self._current,)

    def migration_keys(self) -> tuple[bytes, ...]:
        """Every key a peer may prove with now, the newest first."""
        return tuple(g.migration_key for g in self._generations())

    def accepts_token(self, given: str) -> bool:
        """Whether `given` is a token of the pool now; every comparison in constant time."""
        matches = [hmac.compare_digest(given.encode(), g.token.encode()) for g in self._generations()]
        return any(matches)

    # ------------------------------------------------------------------------------------ rotation

    def rotate(self, new: PoolSecrets) -> bool:
        """Make `new` current (the old values stay valid for the grace period); False if nothing changed."""
        if new == self._current:
            return False
        self._previous, self._previous_until_s = self._current, self._clock() + self.grace_s
        self._current = new
        self.rotations += 1
        log.info("the pool's secrets rotated; the previous ones are accepted for %.0f s more", self.grace_s)
        return True

    async def refresh(self) -> bool:
        """Read the Secret now; True when it held new values. A missing Secret or a failed read keeps
        what this pod has (the operator remakes a deleted Secret within an epoch)."""
        if self._read is None:
            return False
        async with self._lock:
            try:
                data = await self._read()
            except Exception as err:  # the API server may be away for a moment: keep the current values
                log.warning("reading the pool's Secret failed: %s", type(err).__name__)
                return False
            if data is None:
                return False
            try:
                return self.rotate(PoolSecrets.from_data(data))
            except ValueError:
                log.warning("the pool's Secret has an empty token or migration key: ignored")
                return False

    async def refresh_after_miss(self) -> bool:
        """A peer presented a value this pod does not know: re-read the Secret unless that was done less
        than `miss_refresh_s` ago. True when new values arrived (check again)."""
        now = self._clock()
        if self._read is None or now - self._last_miss_refresh_s < self.miss_refresh_s:
            return False
        self._last_miss_refresh_s = now
        return await self.refresh()

    async def keep_fresh(self) -> None:
        """Re-read the Secret every `refresh_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

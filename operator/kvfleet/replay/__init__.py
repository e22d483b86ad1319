"""`kvfleet replay`: a trace slice sent through a live pool's router, and the record of what it did."""

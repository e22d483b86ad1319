"""`python -m kvfleet.demo`: the demo's entry point (see story.py)."""

from kvfleet.demo.story import main

if __name__ == "__main__":
    raise SystemExit(main())

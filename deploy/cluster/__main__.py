"""python -m deploy.cluster up | down | status (see deploy/cluster/__init__.py)."""
import sys

from .cli import main

sys.exit(main())

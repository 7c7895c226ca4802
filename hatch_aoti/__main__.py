"""``python -m hatch_aoti``: the ``hatch-aoti`` command line."""

from hatch_aoti.cli import main

raise SystemExit(main())

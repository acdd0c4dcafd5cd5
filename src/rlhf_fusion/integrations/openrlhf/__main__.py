"""``python -m rlhf_fusion.integrations.openrlhf``: same as ``rlhf-fusion openrlhf``."""

from .launch import main

raise SystemExit(main())

"""Settings split by environment: ``base`` (shared), ``local`` (default, ``make run``),
``production`` (``check --deploy`` clean) and ``test`` (pytest). All read ``controlplane.env``."""

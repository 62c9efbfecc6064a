"""``bench.soak``'s parts, one role per module: ``stack`` (the real ``make run`` stack on the soak's own
PostgreSQL database and redis-server), ``replicas`` (a Ray driver's view of the replica actors),
``fleet`` (tenants, keys, models and the console login, made through the admin API), ``load`` (the
tenants' traffic and its samples), ``operators`` (jobs and console reads during the run), ``faults``
(the schedule and what each fault does), ``checks`` (the invariants, pure functions of what was
recorded) and ``report`` (the table and the ``RESULT`` line)."""

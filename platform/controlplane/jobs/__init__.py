"""Jobs: auditable flush jobs and weight-revision rollouts, run by Celery on every cache worker."""

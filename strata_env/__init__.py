"""Strata's settings from the environment: the one reader of ``os.environ`` for every process.

Strata's own variables carry the ``STRATA_`` prefix; the conventional names ``DATABASE_URL``,
``REDIS_URL``, ``CELERY_BROKER_URL``, ``RAY_ADDRESS`` and ``PORT`` are read as they are so that
standard tooling (docker-compose, PaaS) works unchanged. Pure Python, standard library only: the
web process, the cache workers (and ``cachecore``) and the launcher all import it, and it imports
nothing of Strata's.

- :mod:`strata_env.fields`: the typed readers (boolean, switch, bounded integer, number, list, IP
  networks, string) and the one :class:`EnvError`, which names the variable;
- :mod:`strata_env.views`: ``STRATA_HOME`` and a typed view per kind of process (:func:`load`: the
  control plane; :func:`load_worker`: a cache worker; :func:`load_launcher`: ``make run``);
- :mod:`strata_env.masterkey`: the one reader of the master key.

Other modules read these views (or Django's settings built from them), never ``os.environ``
(``tests/test_one_env_reader.py`` holds the code to that).
"""

from strata_env.fields import FALSE, TRUE, EnvError
from strata_env.masterkey import KEY_BYTES, MasterKeyError
from strata_env.views import (
    DEFAULT_HOME,
    DEFAULT_PORT,
    DEFAULT_RAY_BIND,
    DEFAULT_RAY_PORT,
    REPO_ROOT,
    SAMPLER,
    WARM_REPLICAS,
    LauncherEnv,
    MasterKeyEnv,
    StrataEnv,
    WorkerEnv,
    device,
    enabled_test_hooks,
    home,
    load,
    load_launcher,
    load_worker,
    master_key_env,
    repo_path,
    routing,
    sampler,
    vllm_eager,
    warm_replicas,
    web_share,
    weights_root,
)

__all__ = [
    "DEFAULT_HOME", "DEFAULT_PORT", "DEFAULT_RAY_BIND", "DEFAULT_RAY_PORT", "FALSE", "KEY_BYTES", "REPO_ROOT",
    "SAMPLER", "TRUE", "WARM_REPLICAS", "EnvError", "LauncherEnv", "MasterKeyEnv", "MasterKeyError", "StrataEnv",
    "WorkerEnv", "device", "enabled_test_hooks", "home", "load", "load_launcher", "load_worker", "master_key_env",
    "repo_path", "routing", "sampler", "vllm_eager", "warm_replicas", "web_share", "weights_root",
]

"""Operator UI: server-rendered pages under /ui/ (templates and assets live in ``frontend/``).

``access`` (who may do what: staff sessions, superuser = admin, other staff = viewer), ``forms``
(input shape only), ``present`` (selector results shaped for templates), ``views`` (thin: one
selector or service per request), ``urls``. Live regions are partial templates polled by
``frontend/static/ui/poll.js``.
"""

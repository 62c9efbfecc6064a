"""Stored responses sealed under the tenant's data key: the L3 envelope (``cachecore.crypto``) over
the response's JSON.

``seal`` takes the tenant's active data-key version (``tenants.keystore.data_key_for_worker``: made on
first use) and unwraps it with the master key for that one call; the frame's associated data binds the
response id, the tenant, the key version and the expiry, so a frame copied to another row or tenant,
or whose expiry was edited, does not open. ``open_sealed`` unwraps the frame's own key version from
the database: a version that was shredded (its wrapped key deleted) or a frame that fails to verify
reads as None, exactly like a missing response.
"""

from __future__ import annotations

import json
import logging
import zlib

from cachecore import crypto
from controlplane.tenants.keystore import data_key_for_worker, unwrap_tenant_key
from controlplane.tenants.models import DataKey

logger = logging.getLogger("controlplane.conversations")

NS_DIGEST = b"strata/openai/response"  # the envelope's namespace: a stored response, never a KV object
LAYOUT = {"kind": "openai.response", "encoding": "json+zlib"}


def _aad(tenant_id: int, public_id: str, version: int, expires: int) -> bytes:
    return crypto.associated_data(object_key=public_id.encode(), ns_digest=NS_DIGEST, layout=LAYOUT,
                                  tenant=str(tenant_id), key_version=version,
                                  format_version=crypto.FORMAT_VERSION, expires=expires)


def seal(tenant, public_id: str, payload: dict, expires: int) -> tuple[int, bytes]:
    """``(key version, frame)``: ``payload`` as JSON, compressed, sealed under ``tenant``'s active
    data key. ``expires``: epoch seconds (part of the frame's authenticated header)."""
    active = data_key_for_worker(tenant)
    version = int(active["version"])
    key = unwrap_tenant_key(active["wrapped"], tenant=tenant, version=version)
    plain = zlib.compress(json.dumps(payload, separators=(",", ":")).encode())
    frame = crypto.seal(key, version=version, aad=_aad(tenant.pk, public_id, version, expires), plaintext=plain,
                        expires=expires)
    return version, bytes(frame)


def open_sealed(tenant_id: int, public_id: str, frame: bytes) -> dict | None:
    """The payload of ``frame``, or None when its key version is shredded or missing, or the frame
    does not verify (moved, edited, damaged)."""
    frame = bytes(frame)
    try:
        header = crypto.frame_header(frame)
        wrapped = (DataKey.objects.filter(tenant_id=tenant_id, version=header.key_version, wrapped__isnull=False)
                   .values_list("wrapped", flat=True).first())
        if wrapped is None:
            return None
        key = unwrap_tenant_key(bytes(wrapped), tenant=tenant_id, version=header.key_version)
        plain = crypto.open_frame(key, frame, _aad(tenant_id, public_id, header.key_version, header.expires))
        return json.loads(zlib.decompress(bytes(plain)))
    except (crypto.DecryptError, zlib.error, ValueError):
        logger.warning("stored response %s of tenant %s could not be opened", public_id, tenant_id)
        return None

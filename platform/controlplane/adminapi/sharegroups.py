"""/api/admin/share-groups: explicit cache sharing between tenants."""

from __future__ import annotations

from ninja import Router, Status

from controlplane.adminapi.auth import actor_of
from controlplane.adminapi.present import share_group_out
from controlplane.adminapi.schemas import MemberIn, ShareGroupIn, ShareGroupOut
from controlplane.tenants import access, selectors

router = Router(tags=["share-groups"])


@router.post("share-groups", response={201: ShareGroupOut})
def create_share_group(request, payload: ShareGroupIn):
    group = access.share_group_create(actor=actor_of(request), slug=payload.slug, name=payload.name)
    return Status(201, share_group_out(selectors.share_group_get(slug=group.slug)))


@router.get("share-groups", response=list[ShareGroupOut])
def list_share_groups(request):
    return [share_group_out(g) for g in selectors.share_group_list()]


@router.get("share-groups/{slug}", response=ShareGroupOut)
def get_share_group(request, slug: str):
    return share_group_out(selectors.share_group_get(slug=slug))


@router.post("share-groups/{slug}/members", response={201: ShareGroupOut})
def add_member(request, slug: str, payload: MemberIn):
    access.share_group_add(
        actor=actor_of(request), group=selectors.share_group_get(slug=slug),
        tenant=selectors.tenant_get(slug=payload.tenant),
    )
    return Status(201, share_group_out(selectors.share_group_get(slug=slug)))


@router.delete("share-groups/{slug}/members/{tenant}", response={204: None})
def remove_member(request, slug: str, tenant: str):
    access.share_group_remove(
        actor=actor_of(request), group=selectors.share_group_get(slug=slug), tenant=selectors.tenant_get(slug=tenant)
    )
    return Status(204, None)

"""Who a request is for and where it runs: its tenant, its SLA lane and the prefix-cache salt it may share."""

from __future__ import annotations

from dataclasses import dataclass

from rtxcore.lanes import DEFAULT_LANE, check_lane_name
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.tenants import NotEntitled, Tenant, cache_salt


@dataclass(slots=True, frozen=True)
class Route:
    tenant: Tenant | None
    lane: str
    # Tenant and request salt combined (rtxcore.server.serving.tenants.cache_salt).
    cache_salt: str | None

    @property
    def tenant_name(self) -> str | None:
        return self.tenant.name if self.tenant is not None else None


def route(runtime: ServingRuntime, tenant: Tenant | None, lane: str | None, salt: str | None,
          lane_param: str = "lane") -> Route:
    """The route of a request that asked for ``lane`` (None: its tenant's default) and ``salt``.

    :raises InvalidRequestError: an unknown lane (naming ``lane_param``).
    :raises NotEntitled: a lane its tenant may not use.
    """
    if lane is not None:
        check_lane_name(lane, param=lane_param)
    if tenant is not None:
        try:
            lane = tenant.lane_for(lane)
        except NotEntitled:
            runtime.metrics.record_rejection("not_entitled", lane=lane, tenant=tenant.name)
            raise
    return Route(tenant, lane or DEFAULT_LANE, cache_salt(tenant, salt))

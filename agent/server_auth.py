"""Bearer-key authentication, as litestar's ``AbstractAuthenticationMiddleware``.

Every route but ``/healthz`` needs ``Authorization: Bearer <key>`` when the server has a
key (``SPECRAG_API_KEY`` or ``create_app(api_key=)``); the key is compared in constant
time. A refusal is a 401 in the API's error shape with ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.types import ASGIApp

from specrag.agent.errors import ApiError

OPEN_PATHS = ("/healthz",)


class BearerAuth(AbstractAuthenticationMiddleware):
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        # Every method is guarded (litestar would let OPTIONS through by default).
        super().__init__(app, exclude=[f"^{path}$" for path in OPEN_PATHS], exclude_http_methods=[])
        self.key = api_key.encode()

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        scheme, _, token = connection.headers.get("authorization", "").encode().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            raise ApiError(
                401,
                "a valid 'Authorization: Bearer' key is required",
                type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return AuthenticationResult(user="api-key", auth=None)

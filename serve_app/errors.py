"""OpenAI's error shape for every failure the ingress answers: {"error": {message, type, param, code}}."""

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from core.messages import RequestError
from serve_app.protocol import FieldError


def error_response(error: RequestError, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s and error.status_code in (429, 503) else None
    return JSONResponse(error.to_body(), status_code=error.status_code, headers=headers)


def validation_error(exc: RequestValidationError) -> RequestError:
    """The first pydantic error, as a 400 naming its field (`messages.0.role`, `temperature`)."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first.get('msg', '')}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members add their type name to the location (stop.str, stop.list[str]); keep the field path.
    path = [part for part in loc if not any(ch in part for ch in "[]") and part not in ("str", "int", "list")]
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    param = ".".join(path) or None
    blamed = (first.get("ctx") or {}).get("error")
    if isinstance(blamed, FieldError):  # a cross-field check names the field it blames
        param, message = blamed.param, str(blamed)
    return RequestError(f"{param}: {message}" if param else message, param=param)


def install_error_handlers(app, retry_after_s: int) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _on_http_error(request: Request, exc: HTTPException):
        """Starlette's own refusals (an unknown path or method, a body that is not UTF-8), in OpenAI's shape."""
        response = error_response(RequestError(str(exc.detail), status_code=exc.status_code))
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(RequestError)
    async def _on_request_error(request: Request, exc: RequestError):
        return error_response(exc, retry_after_s)

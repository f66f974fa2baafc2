"""``/docs``: the Swagger UI page of the API, served from the swagger-ui-bundle package
instead of a CDN, so it works on a machine without internet access (FastAPI's own page
loads its scripts from jsdelivr, and is blank offline)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def install_docs(app: FastAPI, openapi_url: str = "/openapi.json") -> None:
    """Add /docs and its assets (create the app with ``docs_url=None``)."""
    from swagger_ui_bundle import swagger_ui_path

    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{app.title} - API docs",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")

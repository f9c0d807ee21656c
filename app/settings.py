"""What the server's handlers share through the aiohttp app: the engine, its metrics and the
settings fixed when the app is built, under typed `web.AppKey`s (aiohttp's idiom for app state).

Its own module so that every route module (app/server.py, app/responses.py) reads them without
importing another route module."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from engine.core.metrics import EngineMetrics
from engine.engine import Engine

from .openai_schema import ServedModel


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None
    served: ServedModel
    openapi: dict
    started: int  # unix time, the models' `created` where no file dates them
    fingerprint: str  # `system_fingerprint`: the model and the backends' configuration
    created: int  # the local model's `created`: its file's modification time


ENGINE = web.AppKey("engine", Engine)
METRICS = web.AppKey("metrics", EngineMetrics)
SETTINGS = web.AppKey("settings", ServerSettings)

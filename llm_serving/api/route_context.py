"""What a routes module may ask of the server: the small interface ``openai_routes``, ``chat_routes`` and
``tgi_routes`` are written against. ``server.Server`` implements it and builds the routes; the routes never
import the server, so adding an API is a new routes module and one line in ``Server._build_app``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from llm_serving.api.generation import Generation
    from llm_serving.api.kv_transfer_routes import KvTransferRoutes
    from llm_serving.config.serving_config import ServingConfig
    from llm_serving.core.sequence import SamplingParams
    from llm_serving.tokenization.chat_template import ChatTemplate
    from llm_serving.tokenization.hf_tokenizer import AnyTokenizer

OFFLOAD_ENCODE_CHARS = 1 << 16  # longer prompts are tokenized off the event loop


class RouteContext(Protocol):
    """The served model's identity and the shared steps of admitting a request (refusals raise ApiError)."""

    config: ServingConfig
    model_name: str  # the main served name
    names: tuple[str, ...]  # every name the model is served under
    default_max_new_tokens: int  # when a body names none
    created: int  # unix time the server was made (OpenAI's model "created")
    kv_transfer: KvTransferRoutes  # prefill/decode disaggregation's export and import around a request

    @property
    def tokenizer(self) -> AnyTokenizer: ...

    @property
    def model_path(self) -> Path: ...

    def chat_template(self) -> ChatTemplate:
        """The served model's chat template (loaded once, on first use: a ConfigError if it cannot be used)."""
        ...

    def check_model(self, name: str | None) -> str: ...

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served now, name -> directory (each a model a request may name)."""
        ...

    def check_accepting(self) -> None: ...

    async def read_body(self, request: web.Request) -> Any: ...

    async def tokenize(self, prompt: str | tuple[int, ...]) -> list[int]: ...

    def start_generation(self, ids: list[int], params: SamplingParams, arrival: float,
                         field_names: Mapping[str, str], request_id: str | None = None,
                         clip: bool = True, follows: str | None = None, model: str | None = None) -> Generation: ...

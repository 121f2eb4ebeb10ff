"""The encoder service.

    python -m services.encoder [--model NAME] [--weights tower.safetensors] [--port 50051] ...

Every flag is also an EPD_ENCODER_* environment variable; ``--help`` lists them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
import uuid
from pathlib import Path

from services.common.config import config_or_exit
from services.common.server import ServerOptions, serve
from services.encoder.config import EncoderConfig
from services.encoder.servicer import EncoderServicer
from services.encoder.vision import VisionConfig
from services.encoder.worker import EncoderWorker
from services.engine.models.loader import load_model_config
from services.pb import encoder_pb2_grpc


def tower_id(vision: VisionConfig) -> bytes:
    """The tower's identity for image hashes: its config, and its weights file's content."""
    weights = hashlib.sha256(Path(vision.weights).read_bytes()).hexdigest() if vision.weights else ""
    return f"{vision}|{weights}".encode()


async def run(config: EncoderConfig) -> int:
    hidden_size = load_model_config(config.model or None).hidden_size
    vision = VisionConfig(out_hidden_size=hidden_size, image_size=config.image_size,
                          patch_size=config.patch_size, seed=config.seed, weights=config.weights or None)
    worker = EncoderWorker(vision, device=config.device)
    servicer = EncoderServicer(worker, f"encoder-{uuid.uuid4().hex[:8]}", config.max_images_per_request,
                               tower_id=tower_id(vision))
    return await serve(lambda server: encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server),
                       ServerOptions.from_config(config), "epd.v1.Encoder")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(config_or_exit(EncoderConfig, argv, "encoder", prog="python -m services.encoder")))


if __name__ == "__main__":
    sys.exit(main())

"""The encoder service.

    python -m services.encoder [--model NAME] [--weights tower.safetensors] [--port 50051] ...
    python -m services.encoder --model /path/llava-dir [--port 50051] ...

A LLaVA model directory brings its own vision tower, projector and image processor; for any
other model the home-made tower (random unless --weights) is sized for its hidden size.

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
from services.encoder.export import exporter_from_config
from services.encoder.llava import LlavaVision, is_llava_dir
from services.encoder.servicer import EncoderServicer
from services.encoder.vision import VisionConfig
from services.encoder.worker import EncoderWorker
from services.engine.models.loader import load_model_config
from services.pb import encoder_pb2_grpc


def tower_id(vision: VisionConfig) -> bytes:
    """The tower's identity for image hashes: its config, and its weights file's content."""
    weights = hashlib.sha256(Path(vision.weights).read_bytes()).hexdigest() if vision.weights else ""
    return f"{vision}|{weights}".encode()


def build_worker(config: EncoderConfig) -> tuple[EncoderWorker, bytes]:
    """The worker for ``config.model`` and its tower's identity: a LLaVA directory's own vision
    tower and projector, else the home-made tower sized for the language model."""
    if is_llava_dir(config.model):
        vision_model = LlavaVision(config.model)
        return EncoderWorker(device=config.device, model=vision_model), vision_model.identity
    hidden_size = load_model_config(config.model or None).hidden_size
    vision = VisionConfig(out_hidden_size=hidden_size, image_size=config.image_size,
                          patch_size=config.patch_size, seed=config.seed, weights=config.weights or None)
    return EncoderWorker(vision, device=config.device), tower_id(vision)


async def run(config: EncoderConfig) -> int:
    worker, identity = build_worker(config)
    worker.max_image_bytes, worker.max_image_pixels = config.max_image_bytes, config.max_image_pixels
    instance_id = f"encoder-{uuid.uuid4().hex[:8]}"
    exporter = exporter_from_config(config, instance_id)  # None: rows inline, no cache
    servicer = EncoderServicer(worker, instance_id, config.max_images_per_request, tower_id=identity,
                               exporter=exporter, inline_max_bytes=config.inline_max_bytes)
    try:
        return await serve(lambda server: encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server),
                           ServerOptions.from_config(config), "epd.v1.Encoder", on_drain=servicer.on_drain,
                           background=[exporter.expire_leases()] if exporter is not None else [],
                           until_settled=exporter.leases.until_empty if exporter is not None else None)
    finally:
        if exporter is not None:
            exporter.close()
            exporter.transfer.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(config_or_exit(EncoderConfig, argv, "encoder", prog="python -m services.encoder")))


if __name__ == "__main__":
    sys.exit(main())

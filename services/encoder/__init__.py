"""The epd encoder: images from chat messages -> embeddings the prefill splices into the prompt.

Offline use::

    from services.encoder import EncoderWorker, VisionConfig
    worker = EncoderWorker(VisionConfig(out_hidden_size=576))
    [emb] = worker.encode(["data:image/png;base64,..."])
    emb.embeddings.shape  # [196, 576]: one row per image placeholder token

Names are imported lazily so that importing the package (e.g. for its error types or in a
torch-free process) does not load torch.
"""

from typing import TYPE_CHECKING

__all__ = ["EncoderWorker", "ImageEmbedding", "VisionConfig", "VisionTower"]

if TYPE_CHECKING:
    from services.encoder.vision import VisionConfig, VisionTower
    from services.encoder.worker import EncoderWorker, ImageEmbedding


def __getattr__(name: str):
    if name in ("VisionConfig", "VisionTower"):
        from services.encoder import vision
        return getattr(vision, name)
    if name in ("EncoderWorker", "ImageEmbedding"):
        from services.encoder import worker
        return getattr(worker, name)
    raise AttributeError(name)

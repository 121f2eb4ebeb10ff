"""The epd encoder: images from chat messages -> embeddings the prefill splices into the prompt.

Offline use::

    from services.encoder import EncoderWorker, VisionConfig
    worker = EncoderWorker(VisionConfig(out_hidden_size=576))
    [emb] = worker.encode(["data:image/png;base64,..."])
    emb.embeddings.shape  # [196, 576]: one row per image placeholder token

    from services.encoder.llava import LlavaVision  # a LLaVA model directory's vision half
    worker = EncoderWorker(model=LlavaVision("/path/llava-1.5-7b-hf"))
    worker.num_patches_per_image  # 576: from the model (patches, CLS dropped by "default")

Names are imported lazily so that importing the package (e.g. for its error types or in a
torch-free process) does not load torch.
"""

from typing import TYPE_CHECKING

__all__ = ["EncoderWorker", "ImageEmbedding", "LlavaVision", "VisionConfig", "VisionTower"]

if TYPE_CHECKING:
    from services.encoder.llava import LlavaVision
    from services.encoder.vision import VisionConfig, VisionTower
    from services.encoder.worker import EncoderWorker, ImageEmbedding


def __getattr__(name: str):
    if name in ("VisionConfig", "VisionTower"):
        from services.encoder import vision
        return getattr(vision, name)
    if name == "LlavaVision":
        from services.encoder import llava
        return llava.LlavaVision
    if name in ("EncoderWorker", "ImageEmbedding"):
        from services.encoder import worker
        return getattr(worker, name)
    raise AttributeError(name)

"""The serving shell: what turns the engine core into a prefill or decode service.

    async_engine.py     the engine thread: an LLMEngine driven from asyncio (calls, streams)
    seam.py             EngineSeam: the one typed async surface the workers and the store
                        connector use (requests, hand-over, reservations, exports, reads)
    instance.py         an instance: engine thread + KV pool registered as a memory region +
                        transfer engine + seam (+ store connector); its settings and server
    store_connector.py  KV store hits read into the prefix cache; new blocks written back

The core (engine, scheduler, block manager, model runner, ...) imports nothing from here, no
gRPC and no transfer code (tests/unit/test_layout.py).
"""

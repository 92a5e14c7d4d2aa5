"""The vLLM backend's front-end side (clef_vllm/backends/vllm_backend.py) against stand-ins of vLLM's
``AsyncLLM`` (no GPU here): a cancelled request aborted in the engine, a dead engine reported, the profiler
window over client decisions, and the kernel report before the engine starts."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading

import pytest
import torch

from conftest import REQUEST

pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("cpu_shims")


def test_vllm_backend_cancels_in_the_engine_and_reports_a_dead_engine(tiny_release):
    """The vLLM backend's request path against a stand-in AsyncLLM (no GPU here)."""
    from support import vllm_cpu
    from vllm.v1.engine.exceptions import EngineDeadError

    from clef_vllm.backends.base import BackendDeadError
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder

    started, cancelled = threading.Event(), threading.Event()

    class StandInEngine:
        errored = False

        def __init__(self, dead: bool):
            self.dead = dead

        async def encode(self, prompt, params, request_id):
            started.set()
            if self.dead:
                raise EngineDeadError()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:    # AsyncLLM.encode aborts the request in the engine core here
                cancelled.set()
                raise
            yield

    encoded = RequestEncoder.from_pretrained(tiny_release).encode(parse_request(REQUEST))
    with vllm_cpu.bare_vllm_backend(max_num_seqs=48, data_parallel_size=2) as backend:
        backend.engine = StandInEngine(dead=False)

        async def cancel_in_flight():
            task = asyncio.ensure_future(backend.decide(encoded))
            assert await asyncio.to_thread(started.wait, 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(cancelled.wait, 60)

        asyncio.run(cancel_in_flight())
        backend.engine = StandInEngine(dead=True)
        with pytest.raises(BackendDeadError, match="engine core died"):
            backend.decide_batch([encoded])
        backend.check_health()
        backend.engine.errored = True
        with pytest.raises(BackendDeadError, match="AsyncLLM.errored"):
            backend.check_health()
        assert backend.suggested_max_in_flight() == 96


def test_the_vllm_backend_never_runs_image_pads_as_text(tiny_release):
    """Its encoder refuses images; an encoded request with images from any other encoder is refused too, before
    the engine sees it (the pads alone would be answered as text)."""
    from support import vllm_cpu
    from clef_vllm.testing.images import data_uri, image_bytes

    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.errors import Kind, RequestError
    from clef_vllm.schema.media import decode_media

    request = parse_request(REQUEST | {"images": [data_uri(image_bytes("PNG"))]})
    decode_media(request._media)
    why = "the server runs with --text-only"
    with pytest.raises(RequestError, match="images: not served: the server runs with --text-only"):
        RequestEncoder.from_pretrained(tiny_release, images=why).encode(request)
    encoded = RequestEncoder.from_pretrained(tiny_release).encode(request)
    assert encoded.media is not None
    with vllm_cpu.bare_vllm_backend() as backend:
        backend.encoder = RequestEncoder.from_pretrained(tiny_release, images=why)
        backend.engine = None                              # never reached
        with pytest.raises(RequestError) as info:
            backend.decide_batch([encoded])
        assert (info.value.kind, info.value.field) == (Kind.UNSUPPORTED, "images")


def test_an_image_request_reaches_the_engine_as_one_pad_per_image_with_its_images(tiny_release, tmp_path):
    """vLLM's prompt of a request with images: the encoder's ids with each image's pads collapsed to one and the
    decoded images (vLLM's processor expands them again; the ids the engine ends up with must be the encoder's);
    the engine's media settings follow the checkpoint and --text-only; state keys differ with the picture."""
    import shutil
    from types import SimpleNamespace

    from support import vllm_cpu

    from clef_vllm.backends.options import VllmOptions
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.backends.vllm_media import ENGINE_MAX_IMAGES, media_prompt
    from clef_vllm.model.features import HeadSpec
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.media import decode_media
    from clef_vllm.testing.images import data_uri, picture

    pictures = {s: data_uri(picture((300, 120), s)) for s in (1, 2, 3)}   # (Pillow's noise differs per call)

    def encoded(*seeds):
        request = parse_request(REQUEST | {"images": [pictures[s] for s in seeds]})
        decode_media(request._media)
        return encoder.encode(request)

    encoder = RequestEncoder.from_pretrained(tiny_release, pixels=False)
    pad = encoder.media.pad_id
    two = encoded(1, 2)
    assert two.media.pixel_values is None and len(two.media.images) == 2
    prompt = media_prompt(two)
    ids = prompt["prompt_token_ids"]
    assert ids.count(pad) == 2 and prompt["multi_modal_data"]["image"] == list(two.media.images)
    counts, expanded = iter(two.media.token_counts), []
    for t in ids:
        expanded += [t] * (next(counts) if t == pad else 1)
    assert expanded == two.input_ids
    # the same ids with another picture: other state keys (the prefix cache and the state cache never mix them)
    other = encoded(1, 3)
    assert other.input_ids == two.input_ids and other.media.digest != two.media.digest
    keys = [HeadSpec.from_encoded(e, state_keys=True).state_keys for e in (two, other, encoded(1, 2))]
    assert keys[0] != keys[1] and keys[0] == keys[2]
    # kept up to the state's end (where the first request's prefill stops): other questions about the same
    # pictures have the same reusable prefix and keys, so they resume from it
    request = parse_request(REQUEST | {"images": [pictures[1], pictures[2]],
                                       "questions": {"blocked": {"type": "noul", "instructions": "Blocked?"}}})
    decode_media(request._media)
    asked_again = encoder.encode(request)
    a, b = (HeadSpec.from_encoded(e, state_keys=True, upto=e.schema_offset) for e in (two, asked_again))
    assert a.reuse_limit == b.reuse_limit == two.schema_offset and a.state_keys == b.state_keys
    assert HeadSpec.from_encoded(two, state_keys=True).reuse_limit > two.schema_offset      # text: the first span

    class StandInEngine:                    # AsyncLLM: vLLM's processor expands the pads
        errored = False
        prompts = []

        async def encode(self, prompt, params, request_id):
            self.prompts.append(prompt)
            spec = params.extra_kwargs["clef"]
            assert spec
            yield SimpleNamespace(prompt_token_ids=two.input_ids, num_cached_tokens=0, finished=True,
                                  outputs=SimpleNamespace(data=torch.full((HeadSpec.from_encoded(two).num_options,), .5)))

    with vllm_cpu.bare_vllm_backend(max_num_seqs=8, data_parallel_size=1) as backend:
        backend.encoder, backend._sees, backend.engine = encoder, True, StandInEngine()
        backend.options = VllmOptions()
        assert backend.decide_batch([two])[0].tolist() == [.5] * HeadSpec.from_encoded(two).num_options
        assert backend.engine.prompts[0]["prompt_token_ids"] == ids

    # engine settings: images through the tower, or every limit 0 (--text-only, or a checkpoint that cannot see)
    seeing = engine_kwargs(tiny_release, VllmOptions())
    assert seeing["limit_mm_per_prompt"]["image"] == {"count": ENGINE_MAX_IMAGES}
    assert seeing["skip_tokenizer_init"] is False
    blind = {"image": 0, "video": 0}
    assert engine_kwargs(tiny_release, VllmOptions(text_only=True))["limit_mm_per_prompt"] == blind
    assert engine_kwargs(tiny_release, VllmOptions(text_only=True))["skip_tokenizer_init"] is True
    no_processor = shutil.copytree(tiny_release, tmp_path / "no-processor")
    (no_processor / "preprocessor_config.json").unlink()
    assert engine_kwargs(no_processor, VllmOptions())["limit_mm_per_prompt"] == blind



def test_a_video_reaches_the_engine_as_one_pad_with_its_frames_and_their_metadata(tiny_release, monkeypatch):
    """A request with an image and a video: vLLM's prompt holds the release's placeholder text per item (vLLM's
    processor expands both; the ids it ends up with must be the encoder's, which the checkpoint's processor made:
    a stand-in here, CI has no torchvision), the image, and the video's frames as decoded with metadata keeping
    every frame at 2 fps; a video of a size seen lately gets its ids without the processor. A video past the largest
    image's tokens is 413, one the processor refuses 422, each naming it; the engine takes videos (dummy: two
    frames of the largest image) only where transformers can run the video processor."""
    import numpy as np

    from clef_vllm.backends import vllm_media
    from clef_vllm.backends.options import VllmOptions
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.errors import Kind, RequestError
    from clef_vllm.schema.media import MediaLimits, decode_media
    from clef_vllm.testing.images import data_uri, picture

    encoder = RequestEncoder.from_pretrained(tiny_release, pixels=False)
    media = encoder.media
    start, end, vpad = media.start_id, media.end_id, media.video_pad_id
    seen = []

    class StandInProcessor:                 # the checkpoint's Qwen3VLProcessor: two frames per temporal patch
        collapse = False                    # transformers 5.25 on: the placeholder's own start and end dropped

        def __call__(self, text, videos, video_metadata, return_tensors):
            (frames,), (meta,) = videos, video_metadata
            seen.append(meta)
            if len(frames) < 2:
                raise ValueError("t:1 must be larger than temporal_factor:2")
            ids = []
            for _ in range(len(frames) // 2):
                ids += [99, start] + [vpad] * 4 + [end]        # "<t seconds>", then the frames' pads
            ids = ids if self.collapse else [start] + ids + [end]
            return {"input_ids": torch.tensor([ids]), "pixel_values_videos": torch.zeros(1),
                    "video_grid_thw": torch.tensor([[len(frames) // 2, 4, 4]])}

    media.video_processor = StandInProcessor()
    frames = [data_uri(picture((64, 48), 50 + k)) for k in range(4)]

    def encode(videos):
        request = parse_request(REQUEST | {"images": [data_uri(picture((96, 64), 1))], "videos": videos})
        decode_media(request._media)
        return encoder.encode(request)

    enc = encode([frames])
    prompt = vllm_media.media_prompt(enc)
    a = enc.media_offset
    block = [start, media.pad_id, end, start, vpad, end] + media.newline_ids
    assert prompt["prompt_token_ids"] == enc.input_ids[:a] + block + enc.input_ids[a + enc.media_tokens:]
    video_ids = [start] + [99, start, vpad, vpad, vpad, vpad, end] * 2 + [end]
    assert enc.input_ids[a:a + enc.media_tokens] == \
        [start] + [media.pad_id] * enc.media.token_counts[0] + [end] + video_ids + media.newline_ids
    assert enc.media.token_counts[1] == 8 and enc.media.pixel_values_videos is None
    calls = len(seen)
    again = encode([[data_uri(picture((64, 48), 80 + k)) for k in range(4)]])      # the same size, other pictures
    assert again.input_ids == enc.input_ids and len(seen) == calls      # ids by size alone: no processor run
    assert not np.array_equal(again.media.videos[0][0], enc.media.videos[0][0])       # its own frames
    media.video_processor.collapse = True                       # a size not seen lately goes through the processor
    assert encode([[data_uri(picture((80, 48), 50 + k)) for k in range(4)]]).input_ids == enc.input_ids
    assert len(seen) == calls + 1                               # the release's ids whatever transformers does
    media.video_processor.collapse = False
    (image,), ((got, meta),) = prompt["multi_modal_data"]["image"], prompt["multi_modal_data"]["video"]
    assert image.size == (96, 64) and got.dtype == np.uint8 and got.shape == (4, 48, 64, 3)
    assert np.array_equal(got[2], np.asarray(decode_first(frames[2])))
    assert meta == {"total_num_frames": 4, "fps": 2.0, "width": 64, "height": 48, "duration": 2.0,
                    "frames_indices": [0, 1, 2, 3], "do_sample_frames": False}
    assert seen[0].fps == 2.0 and list(seen[0].frames_indices) == [0, 1, 2, 3]
    with pytest.raises(RequestError) as info:
        vllm_media.media_prompt(enc, item_tokens=7)
    assert (info.value.kind, info.value.field) == (Kind.MEDIA_TOO_LARGE, "videos[0]") and "8 vision tokens" in \
        info.value.message
    with pytest.raises(RequestError) as info:
        encode([frames[:1]])
    assert (info.value.kind, info.value.field) == (Kind.MEDIA_INVALID, "videos[0]")
    assert "temporal_factor" in info.value.message

    # the engine's settings: videos only where the video processor can run (torchvision installed)
    side = 2048
    opts = VllmOptions(largest_image_pixels=side * side)
    assert vllm_media.video_tokens(media, opts) == media.image_tokens(side, side)      # the largest image's
    assert vllm_media.video_tokens(media, VllmOptions()) is None
    wide = vllm_media.engine_media_limits(MediaLimits(max_images=100, max_videos=20), opts)
    assert (wide.max_images, wide.max_videos, wide.max_pixels) == (vllm_media.ENGINE_MAX_IMAGES,
                                                                   vllm_media.ENGINE_MAX_VIDEOS, side * side)
    monkeypatch.setattr(vllm_media, "processor_backend", lambda: None)
    assert engine_kwargs(tiny_release, opts)["limit_mm_per_prompt"] == {
        "image": {"count": vllm_media.ENGINE_MAX_IMAGES, "width": side, "height": side},
        "video": {"count": vllm_media.ENGINE_MAX_VIDEOS, "num_frames": 2, "width": side, "height": side}}
    monkeypatch.setattr(vllm_media, "processor_backend", lambda: "pil")
    assert engine_kwargs(tiny_release, opts)["limit_mm_per_prompt"]["video"] == 0


def decode_first(uri: str):
    import base64
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")

@pytest.mark.parametrize("processor", ["vllm", "clef"])
@pytest.mark.parametrize("transformers", ["5.23+", "before 5.10"])
def test_vllm_expands_a_video_as_the_release_whatever_the_transformers(tiny_release, processor, transformers):
    """vLLM 0.28's Qwen3-VL processor expands each video with one call of the checkpoint's processor, then calls it
    for the rest of the prompt with the videos taken out and their placeholders left in; transformers 5.23 and later
    refuse that ("... tokens in the text but no videos were passed"), and with a transformers before 5.10 (one vLLM
    allows) it replaces the placeholder's start and end too. Stand-in processors of both kinds: vLLM's own class
    fails on the first and drops the nesting with the second; ``ClefMultiModalProcessor`` (the one registered for the
    architecture) expands the image and the video with both, the video's ids nested in its placeholder's start and
    end as the release's are, each video processed as the encoder processes it."""
    import types

    import numpy as np
    from PIL import Image
    from vllm.config import ModelConfig
    from vllm.model_executor.models.qwen3_vl import Qwen3VLMultiModalProcessor
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from clef_vllm import ARCHITECTURE, plugin
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.schema.media_inputs import VIDEO_PLACEHOLDER, video_metadata
    from clef_vllm.worker.processor import ClefMultiModalProcessor

    plugin.register()
    limits = engine_kwargs(tiny_release)["limit_mm_per_prompt"]
    limits["video"] = {"count": 1, "num_frames": 2, "width": 64, "height": 64}
    config = ModelConfig(model=str(tiny_release), skip_tokenizer_init=False, dtype="bfloat16", enforce_eager=True,
                         max_model_len=2048, runner="pooling", hf_overrides={"architectures": [ARCHITECTURE]},
                         limit_mm_per_prompt=limits)
    proc = MULTIMODAL_REGISTRY.create_processor(config)
    assert type(proc) is ClefMultiModalProcessor
    if processor == "vllm":
        proc.__class__ = Qwen3VLMultiModalProcessor
    tok = proc.info.get_tokenizer()
    start, end, image_pad, video_pad = tok.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])

    class NewTransformersProcessor:          # Qwen3VLProcessor's contract, refusing as transformers >= 5.23 does
        video_token, image_token = "<|video_pad|>", "<|image_pad|>"
        video_processor = types.SimpleNamespace(temporal_patch_size=2, fps=2.0, min_frames=4, max_frames=768,
                                                cap_pixels_per_frame=None)     # transformers >= 5.17's setting
        refuses = True
        video_calls: list[dict] = []

        def replace_video_token(self, video_inputs, video_idx, **kwargs):     # transformers >= 5.10: the bare pad
            raise NotImplementedError

        def __call__(self, text=None, images=None, videos=None, video_metadata=None, return_tensors=None, **kwargs):
            text = text if isinstance(text, str) else text[0]
            if videos:
                self.video_calls.append(kwargs)
            if self.refuses and text.count(self.video_token) != len(videos or []):
                raise ValueError(f"Found {text.count(self.video_token)} {self.video_token} tokens in the text but "
                                 "no videos were passed.")
            out = {}
            if images:
                out |= {"pixel_values": torch.zeros(4 * len(images), 1536),
                        "image_grid_thw": torch.tensor([[1, 2, 2]] * len(images))}
                text = text.replace(self.image_token, "<|image_pad|>")     # one token per 2 x 2 patches
            if videos:
                frames = len(videos[0][0])
                out |= {"pixel_values_videos": torch.zeros(4 * frames // 2, 1536),
                        "video_grid_thw": torch.tensor([[frames // 2, 2, 2]])}
            out["input_ids"] = torch.tensor([tok.encode(text, add_special_tokens=False)])
            return out

    class OldTransformersProcessor(NewTransformersProcessor):     # before 5.10: the whole placeholder, no refusal
        replace_video_token, refuses = None, False
        video_processor = types.SimpleNamespace(temporal_patch_size=2, fps=2.0, min_frames=4, max_frames=768)

    stand_in = NewTransformersProcessor() if transformers == "5.23+" else OldTransformersProcessor()
    proc.info.get_hf_processor = lambda **kwargs: stand_in
    frames = np.zeros((4, 64, 64, 3), np.uint8)
    data = {"images": [Image.new("RGB", (64, 64))],
            "videos": [(frames, dict(video_metadata(4, 64, 64), do_sample_frames=False))]}
    text = "<|vision_start|><|image_pad|><|vision_end|>" + VIDEO_PLACEHOLDER
    if processor == "vllm" and transformers == "5.23+":
        with pytest.raises(ValueError, match="Failed to apply") as info:
            proc._call_hf_processor(text, data, {}, {})
        assert "no videos were passed" in str(info.value.__cause__)
        return
    out = proc._call_hf_processor(text, data, {}, {})
    ids = out["input_ids"][0] if isinstance(out["input_ids"], list) else out["input_ids"][0].tolist()
    if processor == "vllm":          # the whole placeholder replaced: the video's outer start and end are gone
        assert ids[:3] == [start, image_pad, end] and ids[3] != start and ids.count(start) == 1 + 2
        return
    assert ids[:3] == [start, image_pad, end] and ids[3] == start and ids[-1] == end
    assert ids.count(video_pad) == 2 * 1 and ids.count(start) == 1 + 1 + 2      # two temporal groups of one token
    assert tok.convert_tokens_to_ids("<|vision_pad|>") not in ids
    assert out["video_grid_thw"].tolist() == [[2, 2, 2]]
    # the video's own call is given what the encoder gives the video processor: no per-frame cap where it exists
    assert [c.get("cap_pixels_per_frame", "absent") for c in stand_in.video_calls] == (
        [False] if transformers == "5.23+" else ["absent"])


def test_the_engine_core_is_profiled_over_a_window_of_client_decisions(tmp_path, caplog):
    """``CLEF_VLLM_PROFILE=DIR[,START[,COUNT]]``: vLLM's profiler starts before client decision START and
    stops after decision START+COUNT-1; warm-up prompts do not count; a bad value names the variable."""
    from types import SimpleNamespace

    from vllm.config import ProfilerConfig

    from clef_vllm.backends.vllm_backend import VllmBackend, engine_input
    from clef_vllm.model.features import synthetic_spec
    from clef_vllm.util import trace

    assert trace.ProfileWindow.from_env("") is None
    window = trace.ProfileWindow.from_env(str(tmp_path))
    assert (window.directory, window.start, window.count) == (str(tmp_path), 8, 10)
    config = ProfilerConfig(**window.profiler_config())             # what the backend hands vLLM
    assert config.profiler == "torch" and config.torch_profiler_dir == str(tmp_path) and config.ignore_frontend
    assert not config.torch_profiler_with_stack
    stacked = trace.ProfileWindow.from_env(f"{tmp_path},8,3,stack")
    assert (stacked.start, stacked.count, stacked.stack) == (8, 3, True)
    assert ProfilerConfig(**stacked.profiler_config()).torch_profiler_with_stack
    for bad in ("d,x", "d,-1", "d,0,0", ",3", "d,8,3,stacks", "d,8,3,stack,1"):
        with pytest.raises(ValueError, match="CLEF_VLLM_PROFILE"):
            trace.ProfileWindow.from_env(bad)

    calls = []

    class StandIn:                                                   # AsyncLLM's encode and profiler switches
        async def start_profile(self):
            calls.append("start")

        async def stop_profile(self):
            calls.append("stop")

        async def encode(self, prompt, params, request_id):
            calls.append(request_id.split("-")[1])
            n = len(prompt["prompt_token_ids"])
            yield SimpleNamespace(num_cached_tokens=0, prompt_token_ids=list(range(n)), finished=True,
                                  outputs=SimpleNamespace(data=torch.zeros(synthetic_spec(n).num_options)))

    backend = VllmBackend.__new__(VllmBackend)
    backend.state_cache, backend.engine, backend._ids = False, StandIn(), itertools.count()
    backend._profile = trace.ProfileWindow.from_env(f"{tmp_path},1,2")

    async def run():
        ids = list(range(20))
        prompt = engine_input(ids)
        await backend._encode(prompt, ids, synthetic_spec(20), warmup=True)     # request 0: the warm-up's
        for _ in range(4):                                                      # requests 1-4: client decisions 0-3
            await backend._encode(prompt, ids, synthetic_spec(20))

    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        asyncio.run(run())
    assert calls == ["0", "1", "start", "2", "3", "stop", "4"]
    assert "vLLM's profiler started (client decisions 1..2" in caplog.text and "profiler stopped" in caplog.text

    async def broken():
        raise RuntimeError("Profiler is not enabled")

    backend.engine.start_profile = broken                             # a profiler that fails costs no decision
    backend._profile = trace.ProfileWindow.from_env(f"{tmp_path},0,1")
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="clef_vllm"):
        probs, cached = asyncio.run(backend._encode(engine_input(list(range(20))), list(range(20)), synthetic_spec(20)))
    assert probs.numel() == synthetic_spec(20).num_options and calls == ["5"]          # nothing to stop
    assert "CLEF_VLLM_PROFILE: could not start vLLM's profiler (RuntimeError: Profiler is not enabled)" in caplog.text

    # a window longer than the traffic: the server's shutdown stops the profiler, so the files are still written
    # (a c=16 profile asking for decisions 24..71 of 68 once came back empty)
    engine = StandIn()
    engine.shutdown = lambda: calls.append("shutdown")
    backend.engine, backend._profile = engine, trace.ProfileWindow.from_env(f"{tmp_path},1,5")
    backend._loop = asyncio.new_event_loop()
    backend._thread = threading.Thread(target=backend._loop.run_forever, daemon=True)
    backend._thread.start()
    calls.clear()
    for _ in range(3):                                                # client decisions 0-2 of a window 1..5
        backend._submit(backend._encode(engine_input(list(range(20))), list(range(20)), synthetic_spec(20))).result(timeout=30)
    assert calls == ["6", "start", "7", "8"] and backend._profile.running
    with caplog.at_level(logging.WARNING, logger="clef_vllm"):
        backend.close()
    assert calls[-2:] == ["stop", "shutdown"] and not backend._profile.running
    assert "the engine stops after 2 of the window's 5 requests" in caplog.text
    assert not backend._thread.is_alive()
    backend.close()                                                   # closing twice is harmless


def test_nvfp4_kernel_bf16_on_a_checkpoint_without_nvfp4_layers_says_it_changes_nothing(tiny_release, caplog,
                                                                                       monkeypatch):
    """The front end's kernel report (before the engine starts) warns that ``--nvfp4-kernel bf16`` has nothing to
    act on in a checkpoint without NVFP4 W4A4 layers, and stays quiet with the default."""
    from clef_vllm.backends.options import backend_options
    from clef_vllm.backends.vllm_backend import VllmBackend
    from clef_vllm.model.checkpoint import locate_checkpoint
    from clef_vllm.quant import kernels

    monkeypatch.setattr(kernels, "cuda_capability", lambda: (9, 0))      # as on an H200
    for choice, warned in (("bf16", True), ("vllm", False)):
        backend = object.__new__(VllmBackend)
        backend.options = backend_options("vllm", {"nvfp4_kernel": choice})
        backend.kwargs, backend.files = {}, locate_checkpoint(tiny_release)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="clef_vllm"):
            backend._report_kernels()
        assert ("--nvfp4-kernel bf16 changes nothing here" in caplog.text) is warned, choice
        assert "kernels: unquantized" in caplog.text and backend.kernels["capability"] == (9, 0)


def test_closing_the_engine_stops_its_output_handler_before_vllm_kills_the_core():
    """vLLM's ``AsyncLLM.shutdown`` (run here as vLLM's own method on a stand-in engine) stops the engine core
    before it cancels the output handler, which then wakes to the dead core and logs a traceback: on every clean
    exit. ``shutdown_engine`` cancels the handler on the engine's loop first, so nothing is logged, and the
    engine is still shut down."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    from clef_vllm.backends.engine_shutdown import shutdown_engine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    logged = []                                       # what the handler would log (vLLM: a traceback)

    class Core:                                       # the engine core client: its shutdown kills the socket
        def __init__(self):
            self.output = loop.create_future()
            self.down = False

        def shutdown(self, timeout=None):             # vLLM's takes a while (the core's processes end)
            self.down = True
            loop.call_soon_threadsafe(lambda: self.output.done() or self.output.set_exception(EngineDeadError()))
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(timeout=5)

    def engine():
        async def make():
            eng = type("Engine", (), {"shutdown": AsyncLLM.shutdown})()
            eng.engine_core = Core()

            async def output_handler():               # vLLM's: waits on the core, logs whatever it raises
                try:
                    await eng.engine_core.output
                except Exception as exc:  # noqa: BLE001 - as vLLM's handler: whatever the core raised
                    logged.append(f"AsyncLLM output_handler failed: {exc!r}")

            eng.output_handler = asyncio.create_task(output_handler())
            return eng
        return asyncio.run_coroutine_threadsafe(make(), loop).result(timeout=5)

    try:
        plain = engine()                              # vLLM's own order: the traceback this test is about
        plain.shutdown()
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(timeout=5)
        assert logged and "EngineDeadError" in logged[0] and plain.engine_core.down
        logged.clear()
        quiet = engine()
        shutdown_engine(quiet, loop)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(timeout=5)
        assert logged == [] and quiet.engine_core.down and quiet.output_handler.cancelled()
        shutdown_engine(quiet, loop)                  # again, the handler done: only vLLM's shutdown runs
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)

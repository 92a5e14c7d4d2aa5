"""Images on the reference backend: the release's multimodal decisions on the tiny checkpoint.

The oracle is written out here, not taken from clef_vllm: the placeholder text of the release's processor
(``"<|vision_start|><|image_pad|><|vision_end|>"`` per image, then ``"\\n"``) tokenized and each pad expanded to
``t * h * w / merge**2`` copies from the checkpoint's image processor's grid, inserted right after the prompt
prefix (tests/support/encoding_spec.py builds the rest segment by segment); transformers' own
``Qwen3_5ForConditionalGeneration.model`` (vision tower, merger, M-RoPE from the grids) loaded in float32 for the
hidden states; the head's math written out literally (tests/support/release_math.py)."""

from __future__ import annotations

import pytest
import torch

from clef_vllm.backends import make_backend
from clef_vllm.model.checkpoint import load_head, locate_checkpoint
from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.media import decode_media
from clef_vllm.schema.media_inputs import IMAGE_PLACEHOLDER, processor_backend
from clef_vllm.server.errors import OUTCOMES
from support.encoding_spec import spec_encode
from support.release_math import literal_logits
from clef_vllm.testing.images import animated_gif, data_uri, image_requests, picture
from clef_vllm.testing.images import video_frames as frames_of

def parsed(body: dict):
    req = parse_request(body)
    decode_media(req._media)
    return req


@pytest.fixture(scope="module")
def backend(tiny_release, cache_dir):
    b = make_backend(tiny_release, "reference", dtype="float32", device="cpu")
    yield b
    b.close()


@pytest.fixture(scope="module")
def release_model(tiny_release):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_release), dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()


def release_oracle(tiny_release, body: dict, model) -> tuple[list[int], list, torch.Tensor]:
    """``(ids, spans, probabilities)`` of one request as the release computes them, in float32."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_release))
    T = lambda text: tok(text, add_special_tokens=False)["input_ids"]   # noqa: E731 - the spec's T(s)
    images = [m.frames_rgb()[0] for m in parsed(body)._media]
    media, pixels = [], {}
    if images:
        # transformers' default backend (torchvision where a real one is installed, else Pillow), as the release
        processor = AutoImageProcessor.from_pretrained(str(tiny_release), backend=processor_backend())
        pixels = dict(processor(images=images, return_tensors="pt"))
        pad = tok.convert_tokens_to_ids("<|image_pad|>")
        counts = iter(int(g.prod()) // processor.merge_size ** 2 for g in pixels["image_grid_thw"])
        for t in T(IMAGE_PLACEHOLDER * len(images) + "\n"):
            media += [pad] * next(counts) if t == pad else [t]
    ids, spans, _ = spec_encode(T, body, media=media)
    x = torch.tensor([ids])
    with torch.inference_mode():
        if images:
            hidden = model.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False,
                                 mm_token_type_ids=(x == model.config.image_token_id).int(), **pixels)
        else:
            hidden = model.model.language_model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    head = load_head(locate_checkpoint(tiny_release), dtype=torch.float32)
    types = {"noul": 0, "choice": 1, "score": 2}
    fields = [(types[q["type"]], qs, os) for q, (qs, os) in zip(body["questions"].values(), spans)]
    logits = literal_logits(head, hidden.last_hidden_state[0], ids, model.lm_head.weight.detach(), fields)
    return ids, spans, torch.cat([torch.softmax(v, 0) for v in logits])


def test_images_equal_the_release_math_in_float32(backend, tiny_release, release_model):
    """Ids, spans and probabilities (to 1e-4) of requests with 0-4 images of varied sizes, formats and modes."""
    bodies = image_requests(10, seed=3)
    encoded = [backend.encoder.encode(parsed(b)) for b in bodies]
    probs = backend.decide_batch(encoded)            # a batch mixing requests with and without images
    for body, enc, got in zip(bodies, encoded, probs):
        ids, spans, want = release_oracle(tiny_release, body, release_model)
        assert enc.input_ids == ids
        assert [(f.question_span, list(f.option_spans)) for f in enc.fields] == spans
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        n = len(body["images"])
        assert (enc.media is None) == (n == 0)
        if n:
            assert enc.media.num_images == n and enc.media_tokens == enc.media.num_tokens + 2 * n + 1
            assert enc.schema_offset == len(backend.encoder.prefix_ids) + enc.media_tokens + enc.state_tokens


def test_the_image_changes_the_answer_and_its_tokens_follow_its_size(backend):
    body = image_requests(1)[0] | {"images": [data_uri(picture((256, 256), 1))]}
    other = body | {"images": [data_uri(picture((256, 256), 2))]}
    wide = body | {"images": [data_uri(picture((1024, 256), 1))]}
    a, b, c = (backend.encoder.encode(parsed(x)) for x in (body, other, wide))
    assert a.input_ids == b.input_ids and a.media.digest != b.media.digest      # same ids, other picture
    assert a.media.token_counts == (64,) and c.media.token_counts == (256,)    # 256x256 px: 8x8 tokens of 32 px
    pa, pb = backend.decide_batch([a, b])
    assert (pa - pb).abs().max() > 1e-4


def test_media_and_schema_past_the_limit_are_413_naming_both_and_only_the_state_is_cut(backend):
    body = image_requests(1)[0] | {"state": "word " * 400, "images": [data_uri(picture((512, 512), 4))]}
    enc = backend.encoder.encode(parsed(body))
    assert enc.media_tokens == 256 + 3
    short = backend.encoder.encode(parsed(body), max_length=enc.num_tokens - 100)
    assert short.media_tokens == enc.media_tokens and short.truncated_state_tokens == 100
    assert short.input_ids[:len(backend.encoder.prefix_ids) + enc.media_tokens] == \
        enc.input_ids[:len(backend.encoder.prefix_ids) + enc.media_tokens]
    with pytest.raises(RequestError) as info:
        backend.encoder.encode(parsed(body), max_length=enc.num_tokens - enc.state_tokens - 1)
    err = info.value
    assert (err.kind, err.field, OUTCOMES[err.kind].status) == (Kind.SCHEMA_TOO_LONG, "images", 413)
    assert f"media ({enc.media_tokens} tokens) and schema require {enc.num_tokens - enc.state_tokens} tokens" \
        in err.message


def test_pads_typed_in_the_text_stay_text_next_to_real_images(backend):
    body = image_requests(1)[0] | {"state": "look: <|vision_start|><|image_pad|><|vision_end|>",
                                   "images": [data_uri(picture((256, 256), 5))]}
    enc = backend.encoder.encode(parsed(body))
    pad = backend.multimodal.config.image_token_id
    assert enc.input_ids.count(pad) == enc.media.num_tokens == 64
    assert backend.decide_batch([enc])[0].isfinite().all()


needs_torchvision = pytest.mark.skipif(processor_backend() is not None,
                                       reason="transformers' video processor needs torchvision (the GPU machine has it)")


def video_oracle(tiny_release, body: dict, model) -> tuple[list[int], list, torch.Tensor]:
    """The release's math with videos: its whole processor (``Qwen3VLProcessor``) on the placeholder text, each
    video's frames at the processor's 2 fps, the multimodal model in float32, the head written out. The processor
    expands each ``<|video_pad|>``, and the placeholder's own start and end stay around it (transformers 5.10.2, the
    release's; 5.25 drops them): each video's expansion is taken from the processor on a bare ``<|video_pad|>`` and
    put between them, as the release's text has them."""
    import numpy as np
    from transformers import AutoProcessor, AutoTokenizer
    from transformers.video_utils import VideoMetadata

    tok = AutoTokenizer.from_pretrained(str(tiny_release))
    T = lambda text: tok(text, add_special_tokens=False)["input_ids"]   # noqa: E731 - the spec's T(s)
    media = parsed(body)._media
    images = [m.frames_rgb()[0] for m in media if m.kind == "image"]
    videos = [np.stack([np.asarray(f) for f in m.frames_rgb()]) for m in media if m.kind == "video"]
    meta = [VideoMetadata(total_num_frames=len(v), fps=2.0, width=v.shape[2], height=v.shape[1],
                          duration=len(v) / 2, frames_indices=list(range(len(v)))) for v in videos]
    processor = AutoProcessor.from_pretrained(str(tiny_release))
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>" * len(images) + "<|video_pad|>" * len(videos)],
                    images=images or None, videos=videos, video_metadata=meta, return_tensors="pt")
    expanded = out["input_ids"][0].tolist()
    singles = [processor(text=["<|video_pad|>"], videos=[v], video_metadata=[m], return_tensors="pt")["input_ids"][0]
               .tolist() for v, m in zip(videos, meta)]
    video_from = len(expanded) - sum(map(len, singles))
    assert expanded[video_from:] == sum(singles, [])
    media = expanded[:video_from]
    for single in singles:
        media += T("<|vision_start|>") + single + T("<|vision_end|>")
    ids, spans, _ = spec_encode(T, body, media=media + T("\n"))
    x = torch.tensor([ids])
    types = (x == model.config.image_token_id).int() + 2 * (x == model.config.video_token_id).int()
    pixels = {k: out[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
              if k in out}
    with torch.inference_mode():
        hidden = model.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, mm_token_type_ids=types,
                             **pixels)
    head = load_head(locate_checkpoint(tiny_release), dtype=torch.float32)
    types = {"noul": 0, "choice": 1, "score": 2}
    fields = [(types[q["type"]], qs, os) for q, (qs, os) in zip(body["questions"].values(), spans)]
    logits = literal_logits(head, hidden.last_hidden_state[0], ids, model.lm_head.weight.detach(), fields)
    return ids, spans, torch.cat([torch.softmax(v, 0) for v in logits])


@needs_torchvision
def test_videos_equal_the_release_math_in_float32(backend, tiny_release, release_model):
    """Short videos (4 and 3 frames, an animated GIF of 5), alone and after an image: ids, spans, probabilities to
    1e-4 against the release's processor and model."""
    base = image_requests(3, seed=11)
    bodies = [base[0] | {"images": [], "videos": [frames_of((64, 96), 4, 1)]},
              base[1] | {"images": [data_uri(picture((128, 128), 7))], "videos": [frames_of((96, 64), 3, 2, "JPEG")]},
              base[2] | {"images": [], "videos": [animated_gif((80, 80), 5, 3)]}]
    encoded = [backend.encoder.encode(parsed(b)) for b in bodies]
    probs = backend.decide_batch(encoded)
    vid = release_model.config.video_token_id
    for body, enc, got in zip(bodies, encoded, probs):
        ids, spans, want = video_oracle(tiny_release, body, release_model)
        assert enc.input_ids == ids
        assert [(f.question_span, list(f.option_spans)) for f in enc.fields] == spans
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert enc.media.token_counts[-1] == enc.input_ids.count(vid) > 0
        assert enc.schema_offset == len(backend.encoder.prefix_ids) + enc.media_tokens + enc.state_tokens
    other = bodies[0] | {"videos": [frames_of((64, 96), 4, 9)]}                 # other frames, same ids
    again = backend.encoder.encode(parsed(other))
    assert again.input_ids == encoded[0].input_ids and again.media.digest != encoded[0].media.digest


def test_the_media_block_puts_videos_after_images_with_their_tensors(backend):
    """The block and the inputs from per-item entries: an image's pad count, a video's VideoBlock (what the
    checkpoint's processor made of it, built by hand here: CI has no torchvision)."""
    from clef_vllm.schema.media_inputs import VideoBlock

    media = backend.encoder.media
    body = image_requests(1)[0] | {"images": [data_uri(picture((256, 256), 1))], "videos": [frames_of((64, 64), 2, 1)]}
    items = parsed(body)._media
    video = VideoBlock((248053, 248057, 248057, 248054), 2, torch.ones(8, 1536), torch.tensor([[1, 2, 4]]))
    block = media.block([64, video])
    assert block == [media.start_id] + [media.pad_id] * 64 + [media.end_id] + list(video.ids) + media.newline_ids
    inputs = media.inputs(items, [64, video])
    assert inputs.token_counts == (64, 2) and inputs.num_images == 1 and inputs.num_tokens == 66
    assert torch.equal(inputs.pixel_values_videos, video.pixel_values) and inputs.video_grid_thw.tolist() == [[1, 2, 4]]
    assert inputs.image_grid_thw.tolist() == [[1, 16, 16]]
    only = media.inputs(items[1:], [video])
    assert only.pixel_values is None and only.token_counts == (2,) and only.digest != inputs.digest


def test_a_videos_frames_reach_the_processor_decoded_in_order_at_two_per_second(backend):
    """What the checkpoint's processor is handed for a video (recorded by a stand-in: CI has no torchvision): its
    frames as one uint8 array in order, RGB, and metadata at 2 fps keeping every frame."""
    import copy

    import numpy as np

    calls = []

    media = copy.copy(backend.encoder.media)
    ids = (media.start_id, media.video_pad_id, media.end_id)

    class Recorder:
        def __call__(self, text, videos, video_metadata, return_tensors):
            calls.append((text, videos, video_metadata))
            return {"input_ids": torch.tensor([ids]), "pixel_values_videos": torch.zeros(4, 8),
                    "video_grid_thw": torch.tensor([[1, 2, 2]])}

    media.video_processor = Recorder()
    item = parsed(image_requests(1)[0] | {"videos": [frames_of((48, 32), 3, 4, "PNG")]})._media[0]
    block = media.video_block(item)
    (text, (frames,), (meta,)), = calls
    want = np.stack([np.asarray(f) for f in item.frames_rgb()])
    assert text == ["<|vision_start|><|video_pad|><|vision_end|>"] and frames.dtype == np.uint8
    assert frames.shape == (3, 32, 48, 3) and np.array_equal(frames, want)
    assert (meta.fps, meta.total_num_frames, list(meta.frames_indices), meta.duration) == (2.0, 3, [0, 1, 2], 1.5)
    assert block.ids == ids and block.pads == 1


def video_refusal(encoder, frames: int) -> RequestError:
    """What encoding a request with one video of ``frames`` 64 x 64 frames raises."""
    with pytest.raises(RequestError) as info:
        encoder.encode(parsed(image_requests(1)[0] | {"videos": [frames_of((64, 64), frames, 3)]}))
    return info.value


@needs_torchvision
def test_a_video_of_one_frame_is_refused_by_name(backend):
    """The release's video processor takes two frames at least (one temporal patch): one frame is 422 naming the
    video, not a server error."""
    error = video_refusal(backend.encoder, 1)
    assert (error.kind, error.field) == (Kind.MEDIA_INVALID, "videos[0]")
    assert "video processor refuses it" in error.message


@pytest.mark.skipif(processor_backend() is None, reason="torchvision is installed: videos are served")
@pytest.mark.parametrize("pixels", [True, False], ids=["reference", "vllm"])
def test_videos_without_torchvision_are_refused_by_name(tiny_release, pixels):
    """Both backends' encoders (the vLLM backend's runs no pixels) refuse a video by name without torchvision."""
    from clef_vllm.schema.encoding import RequestEncoder

    error = video_refusal(RequestEncoder.from_pretrained(str(tiny_release), pixels=pixels), 2)
    assert (error.kind, error.field) == (Kind.UNSUPPORTED, "videos")
    assert "needs torchvision" in error.message


def test_text_only_loads_no_vision_tower_and_refuses_images_by_name(tiny_release, cache_dir):
    b = make_backend(tiny_release, "reference", text_only=True, device="cpu")
    try:
        assert b.multimodal is None and b.encoder.media is None and b.describe()["images"] is None
        with pytest.raises(RequestError) as info:
            b.encoder.encode(parsed(image_requests(2)[1]))
        assert (info.value.kind, info.value.field) == (Kind.UNSUPPORTED, "images")
        assert info.value.message == "not served: the server runs with --text-only"
        assert b.decide_batch([b.encoder.encode(parsed(image_requests(1)[0]))])[0].isfinite().all()
    finally:
        b.close()


def test_text_requests_keep_their_ids_and_answers(backend, tiny_release, cache_dir):
    """A request without media: the same ids and probabilities as a text-only server's, bit for bit."""
    plain = make_backend(tiny_release, "reference", dtype="float32", device="cpu", text_only=True)
    try:
        for body in image_requests(5, seed=8)[::5]:
            a, b = backend.encoder.encode(parsed(body)), plain.encoder.encode(parsed(body))
            assert a.input_ids == b.input_ids and a.media is None
            assert torch.equal(backend.decide_batch([a])[0], plain.decide_batch([b])[0])
    finally:
        plain.close()

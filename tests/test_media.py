"""Media validation (clef_vllm/schema/media.py) without a server: every bad entry is its own 4xx kind naming the
entry, a valid one ends in the text-only 400 after validation, and media tokens typed in text stay text."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from clef_vllm.schema.dialects import parse_request
from clef_vllm.schema.errors import Kind, RequestError
from clef_vllm.schema.media import MEDIA_TOKENS, decode_media
from clef_vllm.server.errors import OUTCOMES
from clef_vllm.testing.images import data_uri, image_bytes, noisy, png_declaring

REF, WAI = "reference", "workers-ai"
REQUEST = {"model": "clef-flash", "state": "Checkout is down.",
           "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}}


def check(body: dict, dialect: str = REF):
    """Parse and decode as the server does; the request with its validated media."""
    req = parse_request(body, dialect)
    decode_media(req._media)
    return req


def refused(images, dialect=REF, *, kind: Kind, field: str, message: str = "", key="images") -> RequestError:
    with pytest.raises(RequestError) as info:
        check(REQUEST | {key: images}, dialect)
    err = info.value
    assert (err.kind, err.field) == (kind, field), err
    assert message in err.message, err.message
    assert OUTCOMES[err.kind].status < 500
    return err


# --------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                       ("JPEG", "image/jpg")])
@pytest.mark.parametrize("dialect", [REF, WAI])
def test_valid_images_pass_validation_and_are_encoded(encoder, fmt, mime, dialect, tmp_path):
    req = check(REQUEST | {"images": [data_uri(image_bytes(fmt), mime), data_uri(image_bytes("PNG", (1, 1)))]},
                dialect)
    assert [(m.field, m.format, m.width, m.height) for m in req._media] == [("images[0]", fmt, 8, 8),
                                                                             ("images[1]", "PNG", 1, 1)]
    assert req.images is None                       # the base64 text is not kept
    from clef_vllm.model.processor_config import write_processor_configs
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.media_inputs import MediaProcessor

    write_processor_configs(tmp_path)               # the release's processor, next to the Qwen3.5 tokenizer
    images = RequestEncoder(encoder._tok, media=MediaProcessor.from_pretrained(tmp_path, encoder._tok))
    enc = images.encode(req)                        # each scaled up to the processor's 65,536 pixels: 64 tokens
    assert enc.media.token_counts == (64, 64) and enc.media_tokens == 2 * (64 + 2) + 1
    media = enc.input_ids[len(images.prefix_ids):len(images.prefix_ids) + enc.media_tokens]
    assert media == ([248053] + [248056] * 64 + [248054]) * 2 + [198]       # the release's ids (spec: "\n" = 198)
    with pytest.raises(RequestError) as info:       # an encoder without an image processor refuses them by name
        encoder.encode(req)
    assert (info.value.kind, info.value.field, info.value.message) == (
        Kind.UNSUPPORTED, "images", "not served: the checkpoint has no image processor (preprocessor_config.json)")
    assert OUTCOMES[Kind.UNSUPPORTED].status == 400


def test_image_tokens_with_the_image_processor_of_an_older_transformers():
    """transformers before 5.10 (vLLM 0.28 allows 5.5.3 on) read ``images_kwargs`` in ``get_number_of_image_patches``
    without a default for it: the encoder passes one, so an image's token count works with every version."""
    from clef_vllm.schema.media_inputs import MediaProcessor

    class OlderImageProcessor:                # transformers 5.9's method: ``None`` for its third argument fails
        merge_size = 2

        def to_dict(self):
            return {}

        def get_number_of_image_patches(self, height, width, images_kwargs=None):
            pixels = images_kwargs["min_pixels"] if "min_pixels" in images_kwargs else 65536
            return max(height * width, pixels) // (16 * 16)

    ids = {"<|vision_start|>": 1, "<|vision_end|>": 2, "<|image_pad|>": 3}
    assert MediaProcessor(OlderImageProcessor(), ids, [198]).image_tokens(512, 512) == 1024 // 4


def test_gif_is_its_first_frame_in_the_reference_dialect_and_refused_by_workers_ai():
    frames = [Image.new("RGB", (6, 4), c) for c in ("red", "blue", "green")]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    req = check(REQUEST | {"images": [data_uri(out.getvalue(), "image/gif")]})
    assert (req._media[0].format, req._media[0].frames) == ("GIF", 1)
    assert len(req._media[0].frames_rgb()) == 1
    refused([data_uri(out.getvalue(), "image/gif")], WAI, kind=Kind.MEDIA_INVALID, field="images[0]",
            message="image/gif is not accepted")


def test_bare_base64_is_accepted_by_workers_ai_only():
    bare = base64.b64encode(image_bytes("WEBP")).decode()
    assert check(REQUEST | {"images": [bare]}, WAI)._media[0].format == "WEBP"
    refused([bare], REF, kind=Kind.MEDIA_MALFORMED, field="images[0]", message="must be a data: URI")


def test_16_megapixels_pass_on_workers_ai_and_16_38_are_413():
    big = image_bytes("PNG", (4000, 4000), color="white")           # 16.00 MP, a few tens of KB
    assert check(REQUEST | {"images": [data_uri(big)]}, WAI)._media[0].width == 4000
    err = refused([data_uri(image_bytes("PNG", (4096, 4000), color="white"))], WAI, kind=Kind.MEDIA_TOO_LARGE,
                  field="images[0]", message="16,384,000 pixels (16.38 MP); at most 16,000,000")
    assert OUTCOMES[err.kind].status == 413 and OUTCOMES[err.kind].hosted_code == 5021


def test_empty_and_null_media_are_no_media(encoder):
    for body in (REQUEST | {"images": []}, REQUEST | {"images": None, "videos": []}):
        assert encoder.encode(check(body)).num_tokens > 0


# --------------------------------------------------------------------------- refused


def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = png_declaring(100_000, 100_000)
    assert len(bomb) < 200
    for dialect in (REF, WAI):
        refused([data_uri(bomb)], dialect, kind=Kind.MEDIA_TOO_LARGE, field="images[0]", message="pixels")
    # just over the limit, under Pillow's own bomb check: our per-call limit, from the header
    refused([data_uri(png_declaring(5000, 5000))], REF, kind=Kind.MEDIA_TOO_LARGE, field="images[0]",
            message="is 5000x5000 = 25,000,000 pixels")


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_truncated_images_are_422(fmt, mime):
    noisy = Image.effect_noise((64, 64), 64).convert("RGB")
    out = io.BytesIO()
    noisy.save(out, fmt)
    data = out.getvalue()
    for dialect in (REF, WAI):
        err = refused([data_uri(data[: len(data) * 2 // 3], mime)], dialect, kind=Kind.MEDIA_INVALID,
                      field="images[0]")
        assert OUTCOMES[err.kind].status == 422 and OUTCOMES[err.kind].hosted_code == 5012


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_corrupt_images_are_422(fmt, mime):
    data = bytearray(image_bytes(fmt, (32, 32)))
    garbage = bytes(data[:16]) + b"\xff" * (len(data) - 16)          # a right signature, then nonsense
    refused([data_uri(garbage, mime)], REF, kind=Kind.MEDIA_INVALID, field="images[0]")
    refused([data_uri(b"not an image at all", mime)], WAI, kind=Kind.MEDIA_INVALID, field="images[0]")


def test_a_png_with_a_bad_checksum_is_422():
    data = bytearray(image_bytes("PNG", (16, 16)))
    idat = data.index(b"IDAT")
    data[idat + 8] ^= 0xFF                                      # flip a byte of the compressed pixels
    refused([data_uri(bytes(data))], REF, kind=Kind.MEDIA_INVALID, field="images[0]", message="corrupt")


def test_wrong_mime_is_422_naming_both_formats():
    refused([data_uri(image_bytes("JPEG"), "image/png")], WAI, kind=Kind.MEDIA_INVALID, field="images[0]",
            message="declares PNG (its MIME type) but the data is JPEG")
    refused([data_uri(image_bytes("PNG"), "image/svg+xml")], REF, kind=Kind.MEDIA_INVALID, field="images[0]",
            message="image/svg+xml is not accepted")


@pytest.mark.parametrize("entry, message", [
    ("data:image/png;base64,iVBORw0KGgo!", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),          # bad padding
    ("data:image/png,rawbytes", "must be base64-encoded"),
    ("data:image/png;base64", "not a valid data: URI"),
])
def test_bad_base64_and_data_uris_are_400(entry, message):
    for dialect in (REF, WAI):
        err = refused([entry], dialect, kind=Kind.MEDIA_MALFORMED, field="images[0]", message=message)
        assert OUTCOMES[err.kind].status == 400 and OUTCOMES[err.kind].hosted_code == 5006


@pytest.mark.parametrize("entry", ["https://example.com/cat.png", "http://169.254.169.254/latest", "file:///etc/passwd",
                                   "ftp://host/x.png"])
def test_urls_are_not_fetched(entry):
    for dialect in (REF, WAI):
        refused([entry], dialect, kind=Kind.MEDIA_MALFORMED, field="images[0]", message="remote URLs are not fetched")


def test_server_local_paths_are_not_read(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(image_bytes())
    refused([str(path)], REF, kind=Kind.MEDIA_MALFORMED, field="images[0]", message="server-local paths are not read")
    refused(["/etc/passwd"], WAI, kind=Kind.MEDIA_MALFORMED, field="images[0]", message="not valid base64")


def test_entries_must_be_strings():
    refused([{"url": "x"}], REF, kind=Kind.MEDIA_MALFORMED, field="images[0]", message="must be a string")
    refused([data_uri(image_bytes()), 3], WAI, kind=Kind.MEDIA_MALFORMED, field="images[1]")


def test_five_images_on_workers_ai_are_422_naming_the_fifth():
    err = refused([data_uri(image_bytes())] * 5, WAI, kind=Kind.MEDIA_INVALID, field="images[4]",
                  message="at most 4 images")
    assert OUTCOMES[err.kind].hosted_code == 5012
    assert len(check(REQUEST | {"images": [data_uri(image_bytes())] * 5})._media) == 5       # reference: 8
    refused([data_uri(image_bytes())] * 9, REF, kind=Kind.MEDIA_INVALID, field="images[8]")


def test_byte_limits_per_image_and_in_all_on_workers_ai():
    noisy = Image.effect_noise((1400, 1100), 100).convert("RGB")
    out = io.BytesIO()
    noisy.save(out, "PNG", compress_level=0)
    big = out.getvalue()                                        # ~4.4 MiB, 1.5 MP
    assert len(big) > 4 << 20
    refused([data_uri(big)], WAI, kind=Kind.MEDIA_TOO_LARGE, field="images[0]", message="at most 4 MiB per item")
    three = big[: 3 << 20]                                          # (its pixels are never reached: bytes first)
    refused([data_uri(three)] * 3, WAI, kind=Kind.MEDIA_TOO_LARGE, field="images[2]", message="at most 8 MiB")


def test_videos_reference_only():
    frame = data_uri(image_bytes("PNG", (8, 8)))
    req = check(REQUEST | {"videos": [[frame, frame, frame]]})
    assert [(m.kind, m.field, m.frames) for m in req._media] == [("video", "videos[0]", 3)]
    refused([[frame, data_uri(image_bytes("PNG", (4, 4)))]], REF, kind=Kind.MEDIA_INVALID, field="videos[0][1]",
            message="all frames must have one size", key="videos")
    refused([[frame] * 769], REF, kind=Kind.MEDIA_TOO_LARGE, field="videos[0]", message="at most 768", key="videos")
    refused(["data:video/mp4;base64,AAAA"], REF, kind=Kind.MEDIA_INVALID, field="videos[0]",
            message="video files are not decoded", key="videos")
    refused([[frame]] * 2, REF, kind=Kind.MEDIA_INVALID, field="videos[1]", message="at most 1 videos", key="videos")
    refused([[frame]], WAI, kind=Kind.INVALID, field="videos", message="unknown field", key="videos")


# --------------------------------------------------------------------------- offline forms


def test_offline_entries(tmp_path):
    from clef_vllm.schema.media import parse_media

    path = tmp_path / "a.webp"
    path.write_bytes(image_bytes("WEBP"))
    items = parse_media([Image.new("RGB", (3, 2)), image_bytes("JPEG"), path, str(path)], None, local=True)
    decode_media(items)
    assert [(m.format, m.width) for m in items] == [("Image", 3), ("JPEG", 8), ("WEBP", 8), ("WEBP", 8)]
    with pytest.raises(RequestError) as info:
        parse_media([tmp_path / "missing.png"], None, local=True)
    assert (info.value.kind, info.value.field) == (Kind.MEDIA_MALFORMED, "images[0]")
    with pytest.raises(RequestError) as info:
        parse_media([b"\x89PNG" + b"\0" * 40], None, local=True)
    assert (info.value.kind, info.value.field) == (Kind.MEDIA_INVALID, "images[0]")


# --------------------------------------------------------------------------- media tokens typed in text


@pytest.fixture(scope="module")
def encoder(qwen_tokenizer_dir):
    from clef_vllm.schema.encoding import RequestEncoder

    return RequestEncoder.from_pretrained(qwen_tokenizer_dir)


MEDIA_IDS = {248053, 248054, 248056, 248057}


@pytest.fixture(scope="module")
def plain(encoder):
    """The same tokenizer, not recognising special tokens: what a media token's literal text tokenizes to."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(encoder._tok.to_str())
    plain.encode_special_tokens = True
    return plain


def test_the_tokenizer_would_make_media_ids_from_text(encoder):
    """Why the guard exists: the raw tokenizer recognises the media tokens inside any text."""
    raw = encoder._tok.encode("a <|image_pad|> b", add_special_tokens=False).ids
    assert 248056 in raw
    assert {encoder._tok.token_to_id(t) for t in MEDIA_TOKENS} == MEDIA_IDS == set(MEDIA_TOKENS.values())


@pytest.mark.parametrize("typed", ["<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>", "<|video_pad|>",
                                   "x<|vision_end|>y" * 50, "<|vision_start|>" * 3])
def test_media_tokens_typed_in_the_state_or_questions_stay_text(encoder, plain, typed):
    body = {"model": "m", "state": {"log": f"user pasted {typed} here", "n": 1},
            "questions": {"q": {"type": "choice", "instructions": f"Is {typed} a pad?",
                                "criteria": {"a": typed, typed: "b"}},
                          typed: {"type": "noul"}}}
    enc = encoder.encode(parse_request(body))
    assert not MEDIA_IDS & set(enc.input_ids)
    # the literal's ids are those of its text, as a tokenizer that does not recognise special tokens gives them
    for token in MEDIA_TOKENS:
        assert encoder.tokenize(token) == plain.encode(token, add_special_tokens=False).ids
    # and every other id is what it was: the text around a literal is tokenized as before
    text = f"before {typed} after"
    by_id = {MEDIA_TOKENS[t]: encoder.tokenize(t) for t in MEDIA_TOKENS}
    raw = encoder._tok.encode(text, add_special_tokens=False).ids
    assert encoder.tokenize(text) == [i for t in raw for i in by_id.get(t, [t])]


def test_prompt_special_tokens_typed_in_text_are_unchanged(encoder):
    """Only the media tokens are guarded: the release's tokenization of everything else is kept."""
    assert encoder.tokenize("a <|im_start|> b") == encoder._tok.encode("a <|im_start|> b", add_special_tokens=False).ids
    long_state = ("word " * 3000) + "<|image_pad|>" + (" more" * 3000)
    enc = encoder.encode(parse_request({"model": "m", "state": long_state,
                                        "questions": {"q": {"type": "noul", "instructions": "x"}}}))
    assert not MEDIA_IDS & set(enc.input_ids)


# --------------------------------------------------------------------------- offline API (clef_vllm.api.Clef)


def test_offline_api_takes_pil_bytes_and_paths_and_raises_the_same_errors(tiny_release, cache_dir, tmp_path):
    from clef_vllm import Clef

    path = tmp_path / "shot.jpg"
    path.write_bytes(image_bytes("JPEG"))
    with Clef(str(tiny_release), backend="reference") as clef:
        assert clef.systemone({**REQUEST, "images": []})["answers"]["urgent"]["noul"] >= 0       # no media: answered
        shown = clef.systemone(REQUEST | {"images": [Image.new("RGB", (5, 5)), image_bytes("PNG"), path, str(path)]})
        assert shown["usage"]["input_tokens"] == clef.systemone(REQUEST)["usage"]["input_tokens"] + 4 * (64 + 2) + 1
        with pytest.raises(RequestError) as info:
            clef.systemone_batch([REQUEST, REQUEST | {"images": [image_bytes("PNG"), png_declaring(100_000, 100_000)]}])
        assert (info.value.kind, info.value.field) == (Kind.MEDIA_TOO_LARGE, "requests[1].images[1]")
        with pytest.raises(RequestError) as info:
            clef.systemone(REQUEST | {"images": [noisy("PNG")[:900]]})
        assert (info.value.kind, info.value.field) == (Kind.MEDIA_INVALID, "images[0]")
        with pytest.raises(RequestError) as info:
            clef.systemone(REQUEST | {"images": ["https://example.com/x.png"]})
        assert (info.value.kind, info.value.field) == (Kind.MEDIA_MALFORMED, "images[0]")

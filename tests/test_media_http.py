"""Media over HTTP on a real server (loopback): a valid image is answered on both routes (and through Cloudflare's
SDK); each bad image is its own 4xx in the route's envelope, naming the entry and with the dialect's code, never a
5xx or a stack trace; a video is refused by name."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import REQUEST, LiveServer
from support.server_calls import held, metric, post, release, server_timing, wait_until
from clef_vllm.schema.media_inputs import processor_backend
from clef_vllm.testing.images import data_uri, image_bytes, noisy, png_declaring

HOSTED = "/client/v4/accounts/023e105f4ecef8ad9ca31a8372d0c353/ai/run/@cf/cloudflare/clef-flash"
PNG = data_uri(image_bytes("PNG"))


def reference(server: LiveServer, body: dict | bytes, status: int, field: str, message: str) -> dict:
    code, text = server.call("/v1/systemone", body)
    assert "Traceback" not in text
    error = json.loads(text)["error"]
    assert (code, error["param"], error["code"]) == (status, field, status), text
    assert message in error["message"], text
    return error


def hosted(server: LiveServer, body: dict, status: int, hosted_code: int, message: str) -> dict:
    code, text = server.call(HOSTED, {k: v for k, v in body.items() if k != "model"})
    assert "Traceback" not in text
    envelope = json.loads(text)
    assert (code, envelope["success"], envelope["errors"][0]["code"]) == (status, False, hosted_code), text
    assert message in envelope["errors"][0]["message"], text
    return envelope


def answered(server: LiveServer, body: dict, route: str = "/v1/systemone") -> dict:
    """The answer to a request that must succeed (200), on the reference route or the hosted one (unwrapped)."""
    if route == HOSTED:
        body = {k: v for k, v in body.items() if k != "model"}
    code, text = server.call(route, body)
    assert code == 200, text
    return json.loads(text)["result"] if route == HOSTED else json.loads(text)


def test_a_valid_image_is_answered_on_both_routes(live_server):
    plain = answered(live_server, REQUEST)["usage"]["input_tokens"]
    gif = data_uri(image_bytes("GIF"), "image/gif")
    for images in ([PNG], [data_uri(image_bytes("JPEG"), "image/jpeg"), data_uri(noisy("WEBP"), "image/webp")]):
        for route in ("/v1/systemone", HOSTED):
            body = answered(live_server, REQUEST | {"images": images}, route)
            assert body["usage"]["input_tokens"] == plain + len(images) * (64 + 2) + 1     # 64 tokens per small image
            assert 0 <= body["answers"]["urgent"]["noul"] <= 1
    assert answered(live_server, REQUEST | {"images": [gif]})["usage"]["input_tokens"] == plain + 67  # its 1st frame
    if processor_backend() is None:          # torchvision installed: the reference backend serves the video
        body = answered(live_server, REQUEST | {"videos": [[PNG, PNG]]})
        assert body["usage"]["input_tokens"] > plain + 1
    else:
        reference(live_server, REQUEST | {"videos": [[PNG, PNG]]}, 400, "videos", "needs torchvision")


CASES = [
    # (images, reference status, hosted status, hosted code, field, message)
    pytest.param([data_uri(noisy("PNG")[:900])], 422, 422, 5012, "images[0]", "truncated or corrupt", id="truncated-png"),
    pytest.param([data_uri(noisy("JPEG")[:700], "image/jpeg")], 422, 422, 5012, "images[0]", "", id="truncated-jpeg"),
    pytest.param([data_uri(noisy("WEBP")[:500], "image/webp")], 422, 422, 5012, "images[0]", "", id="truncated-webp"),
    pytest.param([PNG, data_uri(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)], 422, 422, 5012, "images[1]", "", id="corrupt"),
    pytest.param([data_uri(png_declaring(100_000, 100_000))], 413, 413, 5021, "images[0]",
                 "declares 10,000,000,000 pixels in its header", id="bomb"),
    pytest.param([data_uri(image_bytes("JPEG"), "image/png")], 422, 422, 5012, "images[0]",
                 "declares PNG (its MIME type) but the data is JPEG", id="wrong-mime"),
    pytest.param(["data:image/png;base64,@@@@"], 400, 400, 5006, "images[0]", "not valid base64", id="bad-base64"),
    pytest.param(["https://example.com/a.png"], 400, 400, 5006, "images[0]", "remote URLs are not fetched", id="url"),
    pytest.param([PNG] * 9, 422, 422, 5012, "images[4]", "", id="nine-images"),    # reference: 8; hosted: 4
    pytest.param([PNG, data_uri(image_bytes("PNG", (4020, 20)))], 422, 422, 5012, "images[1]",
                 "absolute aspect ratio must be smaller than 200", id="aspect-ratio"),
]


@pytest.mark.parametrize("images, status, hosted_status, hosted_code, field, message", CASES)
def test_bad_images_get_their_own_4xx_on_both_routes(live_server, images, status, hosted_status, hosted_code, field,
                                                     message):
    body = REQUEST | {"images": images}
    if field == "images[4]":
        reference(live_server, body, status, "images[8]", "at most 8 images")
        hosted(live_server, body, hosted_status, hosted_code, "images[4]: at most 4 images are allowed, got 9")
        return
    reference(live_server, body, status, field, message)
    envelope = hosted(live_server, body, hosted_status, hosted_code, message)
    assert envelope["errors"][0]["message"].startswith(f"{field}: ")


def test_workers_ai_limits_over_http(live_server):
    sixteen = data_uri(image_bytes("PNG", (4000, 4000), color="white"))
    over = data_uri(image_bytes("PNG", (4096, 4000), color="white"))
    # 16.00 MP: a valid image; two of them (2 x 15,625 tokens) pass the 16,384-token limit: 413 naming the media
    hosted(live_server, REQUEST | {"images": [sixteen, sixteen]}, 413, 5021, "images: media (31255 tokens) and schema")
    hosted(live_server, REQUEST | {"images": [over]}, 413, 5021, "images[0]: is 4096x4000 = 16,384,000 pixels")
    hosted(live_server, REQUEST | {"images": [PNG] * 5}, 422, 5012, "images[4]: at most 4 images")
    hosted(live_server, REQUEST | {"images": [data_uri(image_bytes("GIF"), "image/gif")]}, 422, 5012,
           "image/gif is not accepted")
    hosted(live_server, REQUEST | {"videos": [[PNG]]}, 422, 5012, "videos: unknown field")
    # the reference dialect takes 16.38 MP (the processor's limit is 16,777,216 px): 16,000 tokens each
    reference(live_server, REQUEST | {"images": [over, over]}, 413, "images", "media (32005 tokens) and schema")


def test_pads_typed_in_text_never_become_media(live_server):
    body = REQUEST | {"state": "see <|vision_start|><|image_pad|><|vision_end|> and <|video_pad|>",
                      "questions": {"q": {"type": "noul", "instructions": "Is <|image_pad|> here?"}}}
    code, text = live_server.call("/v1/systemone", body)
    assert code == 200, text                                        # answered: the pads are plain text
    assert 0.0 <= json.loads(text)["answers"]["q"]["noul"] <= 1.0


def test_the_sdk_sees_the_hosted_codes(live_server):
    import cloudflare
    from cloudflare import Cloudflare

    with Cloudflare(api_token="unused", base_url=live_server.url + "/client/v4") as sdk:
        run = {"account_id": "023e105f4ecef8ad9ca31a8372d0c353"}
        body = {k: v for k, v in REQUEST.items() if k != "model"}
        with pytest.raises(cloudflare.UnprocessableEntityError) as err:
            sdk.ai.run("@cf/cloudflare/clef-flash", **run, extra_body=body | {"images": [PNG] * 5})
        assert err.value.body["errors"][0]["code"] == 5012
        shown = sdk.ai.run("@cf/cloudflare/clef-flash", **run, extra_body=body | {"images": [PNG]})
        assert shown["usage"]["input_tokens"] == sdk.ai.run("@cf/cloudflare/clef-flash", **run,
                                                            extra_body=body)["usage"]["input_tokens"] + 67
        assert set(shown["answers"]) == set(REQUEST["questions"])


@pytest.fixture(scope="module")
def holds(tmp_path_factory):
    return tmp_path_factory.mktemp("holds")


@pytest.fixture(scope="module")
def strict_server(tiny_release, cache_dir, holds):
    """Small limits; the media of one 10 x 10 picture (7,200 bytes at 72 a pixel) in progress at a time; the
    ``hold_dir`` fault hook (a decision asking ``hold.NAME`` stays in the engine until ``holds/NAME`` exists)."""
    server = LiveServer(["--model", str(tiny_release), "--backend", "reference", "--max-images", "2",
                         "--max-image-pixels", "100", "--max-image-bytes", "4096", "--max-media-bytes", "6000",
                         "--max-video-frames", "2", "--max-media-memory", "7200"],
                        env={"CLEF_VLLM_FAULTS": f"hold_dir={holds}"}).wait_ready()
    yield server
    server.stop()


def test_the_reference_limits_are_flags(strict_server):
    small = data_uri(image_bytes("PNG", (10, 10)))
    assert answered(strict_server, REQUEST | {"images": [small, small]})["usage"]["input_tokens"] > 130
    reference(strict_server, REQUEST | {"images": [small] * 3}, 422, "images[2]", "at most 2 images")
    reference(strict_server, REQUEST | {"images": [data_uri(image_bytes("PNG", (11, 10)))]}, 413, "images[0]",
              "at most 100 (0.00 MP)")
    reference(strict_server, REQUEST | {"images": [data_uri(noisy("PNG", (40, 40)))]}, 413, "images[0]",
              "per item are allowed")
    reference(strict_server, REQUEST | {"videos": [[small] * 3]}, 413, "videos[0]", "at most 2 are allowed")
    # the workers-ai dialect keeps the hosted limits whatever the flags say
    assert answered(strict_server, REQUEST | {"images": [data_uri(image_bytes("PNG", (11, 10)))] * 3}, HOSTED)


def test_the_media_of_requests_in_progress_stay_within_the_media_memory(strict_server, holds):
    """A request whose media do not fit in ``--max-media-memory`` waits for the one ahead of it (nothing is
    refused or lost); a request without media passes it; one whose client leaves while it waits leaves no trace."""
    small = data_uri(image_bytes("PNG", (10, 10)))
    held_bytes = lambda: metric(strict_server, "clef_media_memory_bytes")       # noqa: E731
    waiting = lambda: metric(strict_server, "clef_media_waiting")               # noqa: E731
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(post, strict_server, held("m1", images=[small]))
        wait_until(lambda: held_bytes() == 7200, "the first request's media held")
        second = pool.submit(post, strict_server, REQUEST | {"images": [small]})
        wait_until(lambda: waiting() == 1, "the second request waiting")
        third = pool.submit(httpx.post, strict_server.url + "/v1/systemone", json=REQUEST | {"images": [small]},
                            timeout=3)                         # its client leaves while it waits
        wait_until(lambda: waiting() == 2, "the third request waiting")
        with pytest.raises(httpx.ReadTimeout):
            third.result()
        wait_until(lambda: waiting() == 1, "the third request gone")
        assert post(strict_server, REQUEST).status_code == 200        # text passes the waiting media
        assert not second.done() and held_bytes() == 7200
        release(holds, "m1")
        assert first.result().status_code == 200
        answer = second.result()
        assert answer.status_code == 200 and server_timing(answer)["queue"] > 0, answer.text
    assert (held_bytes(), waiting()) == (0, 0)


def test_media_flags_are_tuning_flags():
    from clef_vllm.server.cli import build_parser

    parser = build_parser()
    for dest in ("max_images", "max_videos", "max_video_frames", "max_image_pixels", "max_image_bytes",
                 "max_media_bytes", "max_media_pixels", "max_media_memory"):
        assert dest in parser.clef_tuning

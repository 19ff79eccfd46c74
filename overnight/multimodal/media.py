"""Images from where users point: PIL images, `data:` URIs, local files (only under the folder the user
allows), and http(s) URLs (only when the user turns fetching on, with a size and a time limit).

Every refusal is a MediaError (an InvalidRequestError: a 400, or an error line in a batch) naming the
reason; nothing here crashes the engine.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from PIL import Image

from overnight.errors import InvalidRequestError


class MediaError(InvalidRequestError):
    pass


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: str | None = None
    allow_media_urls: bool = False
    fetch_timeout: float = 10.0
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024

    @classmethod
    def from_options(cls, options: Any) -> MediaPolicy:
        return cls(
            allowed_local_media_path=options.allowed_local_media_path,
            allow_media_urls=options.allow_media_urls,
            fetch_timeout=options.media_fetch_timeout,
            max_image_bytes=options.max_image_bytes,
            max_image_pixels=options.max_image_pixels,
        )


def load_image(source: Any, policy: MediaPolicy) -> Image.Image:
    """A decoded RGB image from a PIL image, a data URI, a file:// URL or path, or an http(s) URL."""
    if isinstance(source, Image.Image):
        return _checked(source, policy)
    if not isinstance(source, str):
        raise MediaError(f"an image must be a PIL image or a URL string, not {type(source).__name__}")
    if source.startswith("data:"):
        return _decode(_data_uri_bytes(source, policy), policy)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return _decode(_fetch(source, policy), policy)
    if scheme == "file":
        return _decode(_read_local(urllib.parse.unquote(urllib.parse.urlsplit(source).path), policy), policy)
    if scheme and len(scheme) > 1:  # a Windows drive letter is not a scheme
        raise MediaError(f"image URL scheme {scheme!r} is not supported (use data:, file:// or http(s))")
    return _decode(_read_local(source, policy), policy)


def _data_uri_bytes(uri: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep or ";base64" not in header:
        raise MediaError("image data URI must be base64 (data:image/...;base64,...)")
    if len(payload) * 3 // 4 > policy.max_image_bytes:
        raise MediaError(
            f"image is larger than the limit of {policy.max_image_bytes} bytes (max_image_bytes)"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("image data URI is not valid base64") from None


def _read_local(path: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if not root:
        raise MediaError(
            "local image files are refused: start with --allowed-local-media-path to allow a folder"
        )
    real = os.path.realpath(path)
    allowed = os.path.realpath(root)
    if os.path.commonpath([real, allowed]) != allowed:
        raise MediaError(f"image path {path!r} is outside the allowed folder (--allowed-local-media-path)")
    try:
        size = os.path.getsize(real)
        if size > policy.max_image_bytes:
            raise MediaError(
                f"image is larger than the limit of {policy.max_image_bytes} bytes (max_image_bytes)"
            )
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise MediaError(f"cannot read image file {path!r}: {e.strerror or e}") from None


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_media_urls:
        raise MediaError("http(s) image URLs are not fetched unless --allow-media-urls is set")
    try:
        with urllib.request.urlopen(url, timeout=policy.fetch_timeout) as resp:  # noqa: S310 (scheme checked)
            data = resp.read(policy.max_image_bytes + 1)
    except OSError as e:
        raise MediaError(f"cannot fetch image {url!r}: {e}") from None
    if len(data) > policy.max_image_bytes:
        raise MediaError(
            f"image is larger than the limit of {policy.max_image_bytes} bytes (max_image_bytes)"
        )
    return data


def _decode(data: bytes, policy: MediaPolicy) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        w, h = image.size
        if w * h > policy.max_image_pixels:
            raise MediaError(
                f"image of {w}x{h} pixels is over the limit of {policy.max_image_pixels} (max_image_pixels)"
            )
        image.load()
    except MediaError:
        raise
    except Exception as e:  # PIL raises many kinds for broken data
        raise MediaError(f"cannot decode image: {type(e).__name__}: {e}") from None
    return _checked(image, policy)


def _checked(image: Image.Image, policy: MediaPolicy) -> Image.Image:
    w, h = image.size
    if w * h > policy.max_image_pixels:
        raise MediaError(
            f"image of {w}x{h} pixels is over the limit of {policy.max_image_pixels} (max_image_pixels)"
        )
    if w < 1 or h < 1:
        raise MediaError("image is empty")
    return image.convert("RGB") if image.mode != "RGB" else image

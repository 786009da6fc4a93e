"""The tray icon, drawn with Pillow: one look per state."""

from __future__ import annotations

from PIL import Image, ImageDraw

STATES = {
    "stopped": (128, 128, 128),
    "idle": (46, 160, 67),
    "loading": (230, 160, 20),
    "generating": (30, 110, 220),
    "error": (210, 40, 40),
}


def icon_image(state: str, size: int = 64) -> Image.Image:
    """A filled disc in the state's colour with a white 'L'; stopped is a hollow ring."""
    color = STATES[state]
    img = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    m = size // 16
    if state == "stopped":
        d.ellipse((m, m, size - m, size - m), outline=color, width=max(2, size // 10))
    else:
        d.ellipse((m, m, size - m, size - m), fill=color)
    w = max(2, size // 9)
    x0, y0, y1 = size * 0.36, size * 0.26, size * 0.72
    d.rectangle((x0, y0, x0 + w, y1), fill=(255, 255, 255, 255))
    d.rectangle((x0, y1 - w, size * 0.66, y1), fill=(255, 255, 255, 255))
    if state == "error":
        d.rectangle((size * 0.70, size * 0.22, size * 0.70 + w, size * 0.52), fill=(255, 255, 255, 255))
    return img

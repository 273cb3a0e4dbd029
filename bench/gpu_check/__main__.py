"""python -m gapless.bench.gpu_check prepare [...] | run [...]"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if argv[:1] == ["prepare"]:
        from gapless.bench.gpu_check.prepare import main as prepare

        return prepare(argv[1:])
    if argv[:1] == ["run"]:
        from gapless.bench.gpu_check.run import main as run

        return run(argv[1:])
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

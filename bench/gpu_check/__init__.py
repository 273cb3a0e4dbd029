"""The offline GPU check: `prepare` writes a bundle where the package index is reachable, `run`
installs it on a GPU host without network and writes one report (README, "On a GPU")."""

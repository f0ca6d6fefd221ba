"""`k31 sandbox`: a local multi-host cluster of podman containers (systemd as PID 1, sshd, python3)
on a private network, from a locally built image, with an inventory that follows the inventory
contract. CI and newcomers deploy onto it with the CPU stand-in engine."""

from pathlib import Path

# Recipe files of the image, containers.conf and shapes.yaml.
DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "sandbox"

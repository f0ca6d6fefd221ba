"""Lookup k31_bundle: write this checkout's k31deploy bundle for the stand-in engines (k31deploy/bundle.py), in the
controller's own process, where a command task forked two Pythons for it on every deploy and redeploy."""

from __future__ import annotations

import base64
from pathlib import Path

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

try:
    from k31deploy.bundle import write_bundle
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleLookupError(f"k31_bundle needs the k31deploy package (pip install -e .): {exc}") from exc

DOCUMENTATION = r"""
name: k31_bundle
short_description: Write the stand-in engines' bundle of this checkout's k31deploy package on the controller
description:
  - Same sources, same bytes (k31deploy/bundle.py); the file is rewritten only when its content changed.
options:
  _terms:
    description: The bundle's path on the controller (one).
    required: true
  base64:
    description: Also return the bundle's bytes, base64 (C(base64)), for k31_files to write on a host.
    type: bool
    default: false
"""

RETURN = r"""
_raw:
  description: >-
    One dict per path, C(changed) (whether the file was rewritten) and C(digest) (what a host records); with
    C(base64), the bytes too.
  type: list
  elements: dict
"""


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        out = []
        for term in terms:
            path = Path(str(term))
            changed, digest = write_bundle(path)
            out.append({"changed": changed, "digest": digest,
                        **({"base64": base64.b64encode(path.read_bytes()).decode()} if self.get_option("base64")
                           else {})})
        return out

"""k31: deploy Kimi-K3.1-Pro serving with SGLang across GPU clusters.

The recipe's rules live in one place: the catalog (``k31deploy/data``) and the resolver
(``k31deploy.recipe``). Everything else -- the CLI, the Ansible filter plugin, the roles -- consumes
the resolved plan.
"""

__version__ = "0.1.0"

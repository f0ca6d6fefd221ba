"""`python -m k31deploy.standin <the argv sglang.launch_server would get>`."""

import sys

from k31deploy.standin.server import main

sys.exit(main())

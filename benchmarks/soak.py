"""`python benchmarks/soak.py --all`: the served soak's command line (`--help` lists the options).

The soak itself is the package benchmarks/soak/ beside this file: run as a script, this file's
folder is first on sys.path, and there a package is found before a module of the same name,
so `import soak` below (and tests/test_soak.py's) is the package, never this file.
"""

import sys

from soak import main

if __name__ == "__main__":
    sys.exit(main())

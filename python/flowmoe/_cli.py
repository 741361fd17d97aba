"""The `flowmoe` command of `pip install .` (pyproject.toml [project.scripts]): runs the command-line
tool installed with the package (flowmoe/bin/flowmoe, built with the library) with the same
arguments, in this process (exec), so its exit status and output are the tool's own."""

import os
import sys


def tool_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "flowmoe")


def main() -> int:
    path = tool_path()
    if not os.access(path, os.X_OK):
        print(f"flowmoe: the command-line tool is not installed with this package ({path} is missing); expected "
              "a package installed with `pip install .` from the repository (or use build/flowmoe of a CMake build)",
              file=sys.stderr)
        return 2
    os.execv(path, [path] + sys.argv[1:])
    return 0  # (not reached)


if __name__ == "__main__":
    sys.exit(main())

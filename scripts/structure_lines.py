"""Print `- `file` — first docstring line` for every module under a package folder.

    python scripts/structure_lines.py ember/server
"""

import ast
import pathlib
import sys

for folder in sys.argv[1:]:
    for path in sorted(pathlib.Path(folder).glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        print(f"- `{path.name}` — {first}")

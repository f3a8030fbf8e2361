"""Sphinx configuration of the course site (built by tools/build_site.py; `make site`).

tools/build_site.py copies this folder, the notebooks (with a provenance line added at the top of
each) and a generated landing page into a staging folder, then runs Sphinx on it. The notebooks
are rendered with their committed outputs: MyST-NB never executes them here.
"""
project = "Honest host-to-device copies in PyTorch"
author = "the pinlab course"
copyright = "the pinlab course authors, MIT licence"

extensions = ["myst_nb", "sphinx_copybutton"]
# a copy button on code (cell inputs, the install cell), not on outputs: MyST-NB wraps an output's
# highlight block in a div of class "output"
copybutton_selector = "div:not(.output) > div.highlight pre"
copybutton_exclude = ".linenos, .gp, .go"
nb_execution_mode = "off"            # render the committed outputs; never run a notebook here
nb_merge_streams = True
# a Markdown output (notebook 00's syllabus, Markdown(pinlab.syllabus.markdown())) is read as MyST, like the pages:
# its table renders as a table (CommonMark, MyST-NB's default, has no tables) and its links to other notebooks
# ("01_pinned_memory.ipynb") become links to their pages, not to the .ipynb files
nb_render_markdown_format = "myst"
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "**/src", "**.ipynb_checkpoints"]
suppress_warnings = ["myst.header"]  # lessons use bold lead-ins after their title, not a strict h2/h3 ladder

html_theme = "furo"
html_title = project
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_favicon = "_static/favicon.svg"
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None

# The JupyterLab of `make lab` (tools/lab.py puts this folder first on JUPYTER_CONFIG_PATH, so this file has the
# last word over ~/.jupyter and the system's config).
#
# tools/lab.py hands the server its token in PINLAB_LAB_TOKEN (not on the command line, which `ps` shows to every
# user of the machine). This file takes it out of the server's environment before any kernel or terminal starts:
# they copy the server's os.environ, so no kernel (and nothing a notebook prints or runs) holds the token.
import os

_token = os.environ.pop("PINLAB_LAB_TOKEN", None)
if _token:
    c = get_config()  # noqa: F821  (traitlets runs this file with get_config defined)
    # PasswordIdentityProvider is the server's default; a subclass's section would win over IdentityProvider's
    c.IdentityProvider.token = _token
    c.PasswordIdentityProvider.token = _token

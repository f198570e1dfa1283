"""Where a database password comes from, declared once for the SQL reader, the pods and the Argo steps.

The password of a SQL dataset's database is never part of a URL, a flag or a log line: the reader takes it
from :data:`PASSWORD_ENV`. On Kubernetes that variable comes from the key :data:`SECRET_KEY` of a Secret
(``--db-secret``; the steps' ``db-secret`` input), as an optional ``secretKeyRef``: a database without a
password needs no Secret.
"""

#: The environment variable the SQL reader takes the database password from.
PASSWORD_ENV = "EDL_DB_PASSWORD"
#: The key of the password in a ``--db-secret`` Secret.
SECRET_KEY = "password"
#: The Secret the Argo steps name by default.
DEFAULT_SECRET = "edl-argo-db"

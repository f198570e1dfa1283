"""Run a SQLFlow statement (`edl-argo sql`): SELECT ... TO TRAIN a premade model (its job runs in the
step's pod), TO PREDICT into a new table, or TO EVALUATE into a table of metrics. The database password
comes from the key password of the Secret named by db-secret (optional)."""

from edl_argo.hera import SQL, workflow_template

MANIFESTS = [workflow_template(SQL, description=__doc__)]

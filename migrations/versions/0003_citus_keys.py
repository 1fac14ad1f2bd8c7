"""citus keys: run_id in the primary key of every per-run table

Citus distributes the per-run tables by ``run_id``; it refuses a PRIMARY KEY or UNIQUE index that
does not include the distribution column, and shard moves (logical replication) need a primary key
on every table that is updated or deleted from. Two tables did not comply:

- ``ingest_fragments``: primary key ``(id)`` becomes ``(run_id, id)``. ``id`` stays a BIGSERIAL, so
  it is still unique on its own and the compactor's ``ORDER BY id LIMIT`` / ``DELETE ... WHERE
  id = ANY(...)`` keep their meaning; a plain (non-unique, so Citus-compatible) index on ``id``
  keeps them index scans (without it the delete of a 5,000-fragment pass seq-scans the queue with
  a linear ``= ANY``: ~650 ms at 50k queued fragments instead of ~7 ms).
- ``modality_raw`` had no primary key. It is a landing queue like ``ingest_fragments``: a retried
  batch lands its rows again and the compactor keeps the first copy of each
  ``(run, step, rank, modality)``. A primary key on that natural key would make the retried batch's
  COPY fail, so the table gets a surrogate BIGSERIAL ``id`` and the primary key ``(run_id, id)``.
  Existing rows are numbered by the ADD COLUMN and all kept: no deduplication is needed.

Revision ID: 0003
Revises: 0002
"""
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_constraint(op.f('pk_ingest_fragments'), 'ingest_fragments', type_='primary')
    op.create_primary_key(op.f('pk_ingest_fragments'), 'ingest_fragments', ['run_id', 'id'])
    op.create_index(op.f('ix_ingest_fragments_id'), 'ingest_fragments', ['id'], unique=False)
    # BIGSERIAL (sequence modality_raw_id_seq owned by the column), like ingest_fragments.id;
    # ADD COLUMN numbers the rows already there
    op.execute("ALTER TABLE modality_raw ADD COLUMN id BIGSERIAL NOT NULL")
    op.create_primary_key(op.f('pk_modality_raw'), 'modality_raw', ['run_id', 'id'])


def downgrade() -> None:
    op.drop_constraint(op.f('pk_modality_raw'), 'modality_raw', type_='primary')
    op.drop_column('modality_raw', 'id')  # drops the owned sequence too
    op.drop_index(op.f('ix_ingest_fragments_id'), table_name='ingest_fragments')
    op.drop_constraint(op.f('pk_ingest_fragments'), 'ingest_fragments', type_='primary')
    op.create_primary_key(op.f('pk_ingest_fragments'), 'ingest_fragments', ['id'])

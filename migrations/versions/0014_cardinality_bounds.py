"""cardinality bounds: the names a run keeps (run_names) and what was folded or dropped (run_folded)

``run_names`` holds, per run and kind, the names admitted under a bound of ``server/limits.py``:
``phase`` (custom phase names, at most MAX_PHASE_NAMES_PER_RUN; later ones fold into the overflow
phase at compaction) and ``node`` (host / node names, at most MAX_NODES_PER_RUN; later ones are
dropped from the rank at ingest). Admission happens under a per-run lock (the compaction partition
lock, an advisory lock at ingest), so the bound holds across batches and server instances.
``run_folded`` counts, per run and bound, the records folded or dropped to keep it.

Revision ID: 0014
Revises: 0013
"""
from alembic import op
import sqlalchemy as sa

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def _fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f(f'fk_{table}_run_id_runs'), ondelete='CASCADE')


def upgrade() -> None:
    op.create_table(
        'run_names',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('name', sa.String(length=256), nullable=False),
        _fk('run_names'),
        sa.PrimaryKeyConstraint('run_id', 'kind', 'name', name=op.f('pk_run_names')),
    )
    op.create_table(
        'run_folded',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('bound', sa.String(length=64), nullable=False),
        sa.Column('records', sa.BigInteger(), nullable=False),
        _fk('run_folded'),
        sa.PrimaryKeyConstraint('run_id', 'bound', name=op.f('pk_run_folded')),
    )


def downgrade() -> None:
    op.drop_table('run_folded')
    op.drop_table('run_names')

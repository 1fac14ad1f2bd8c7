"""run scalars: training scalars (``run.log``: loss, learning rate, grad norm, user metrics) per step

``run_scalar_names`` holds each scalar name a run logged, once (at most ``MAX_SCALAR_NAMES_PER_RUN``:
the bound is checked against it under the run's event lock), with its summary kept at ingest: the
value at the last step (``last_step``/``last_rank``/``last_value``: the lowest rank at the highest step)
and the smallest value (``min_value``) — what the runs table and ``GET /api/v1/runs`` sort and filter
by (``scalar.NAME.last`` / ``.min``) with one join, whatever the number of points. ``run_scalars`` holds one value per
(run, name, step, rank), the first one logged (at most ``MAX_SCALAR_POINTS_PER_RUN`` per run; further
points are dropped and counted in ``run_event_counts`` kind ``scalars``, whose ``stored`` counts the
points kept). The agent sends them as ``scalars`` events; they do not go to ``run_events``.

Revision ID: 0017
Revises: 0016
"""
from alembic import op
import sqlalchemy as sa

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def _fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f(f'fk_{table}_run_id_runs'), ondelete='CASCADE')


def upgrade() -> None:
    op.create_table(
        'run_scalar_names',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('last_step', sa.BigInteger(), nullable=True),
        sa.Column('last_rank', sa.Integer(), nullable=True),
        sa.Column('last_value', sa.Double(), nullable=True),
        sa.Column('min_value', sa.Double(), nullable=True),
        _fk('run_scalar_names'),
        sa.PrimaryKeyConstraint('run_id', 'name', name=op.f('pk_run_scalar_names')),
    )
    op.create_table(
        'run_scalars',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('step', sa.BigInteger(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('value', sa.Double(), nullable=False),
        _fk('run_scalars'),
        sa.PrimaryKeyConstraint('run_id', 'name', 'step', 'rank', name=op.f('pk_run_scalars')),
    )


def downgrade() -> None:
    op.drop_table('run_scalars')
    op.drop_table('run_scalar_names')

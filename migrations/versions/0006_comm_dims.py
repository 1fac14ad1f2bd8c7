"""parallel dimensions of collectives: run_dims, run_collectives.dim, step_comm

Collectives name the parallel dimension of their process group (dp, tp, pp, ...). Blocks store it as
an int code (``codec.dim_code``); ``run_dims`` keeps each run's names. ``run_collectives`` gains the
dim in its key. ``step_comm`` holds, per step and dimension, the cross-rank medians of the per-rank
sums (calls, bytes, total and exposed seconds) that ``comm_by_dim`` is the median over steps of;
dim -1 is every point-to-point call (send/recv) of the step, the pipeline bubble.

Revision ID: 0006
Revises: 0005
"""
from alembic import op
import sqlalchemy as sa

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'run_dims',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('code', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint('run_id', 'code', name=op.f('pk_run_dims')),
    )
    op.add_column('run_collectives', sa.Column('dim', sa.Integer(), nullable=False, server_default='0'))
    op.drop_constraint('pk_run_collectives', 'run_collectives', type_='primary')
    op.create_primary_key('pk_run_collectives', 'run_collectives', ['run_id', 'op', 'group_size', 'size_bucket', 'dim'])
    op.create_table(
        'step_comm',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('dim', sa.Integer(), nullable=False),
        sa.Column('calls', sa.Double(), nullable=False),
        sa.Column('bytes', sa.Double(), nullable=False),
        sa.Column('total_s', sa.Double(), nullable=False),
        sa.Column('exposed_s', sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint('run_id', 'step', 'dim', name=op.f('pk_step_comm')),
    )


def downgrade() -> None:
    op.drop_table('step_comm')
    op.drop_constraint('pk_run_collectives', 'run_collectives', type_='primary')
    op.drop_column('run_collectives', 'dim')
    op.create_primary_key('pk_run_collectives', 'run_collectives', ['run_id', 'op', 'group_size', 'size_bucket'])
    op.drop_table('run_dims')

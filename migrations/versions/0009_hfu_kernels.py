"""hardware FLOPs per step (HFU) and kernel hotspots over a run's sampled trace windows

``steps.hw_flops``: the step's hardware FLOPs summed over ranks (padded tokens and activation
recomputation included; ``steps.flops`` holds model FLOPs). NULL: not measured.

Kernel hotspots (server/analysis/kernels.py) fold the agent's ``trace_summary`` events into bounded
per-run tables: ``run_kernels`` one row per (run, rank, kernel name) with at most
``analysis.kernels.MAX_NAMES`` names per run (later names are summed into their category's
"other" row), ``run_kernel_ranks`` one row per (run, rank) with its windows and profiled steps,
``run_kernel_windows`` the (run, rank, event seq) of every folded window (so each folds once).

Revision ID: 0009
Revises: 0008
"""
from alembic import op
import sqlalchemy as sa

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('steps', sa.Column('hw_flops', sa.Double(), nullable=True))
    op.create_table(
        'run_kernels',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=512), nullable=False),
        sa.Column('category', sa.String(length=16), nullable=False),
        sa.Column('time_us', sa.Double(), nullable=False),
        sa.Column('launches', sa.BigInteger(), nullable=False),
        sa.Column('windows', sa.Integer(), nullable=False),
        sa.Column('first_us', sa.Double(), nullable=False),
        sa.Column('last_us', sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_kernels_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'name', name=op.f('pk_run_kernels')),
    )
    op.create_table(
        'run_kernel_ranks',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('windows', sa.Integer(), nullable=False),
        sa.Column('steps', sa.Integer(), nullable=False),
        sa.Column('kernel_us', sa.Double(), nullable=False),
        sa.Column('first_step', sa.Integer(), nullable=False),
        sa.Column('last_step', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_kernel_ranks_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank', name=op.f('pk_run_kernel_ranks')),
    )
    op.create_table(
        'run_kernel_windows',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_kernel_windows_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'seq', name=op.f('pk_run_kernel_windows')),
    )


def downgrade() -> None:
    op.drop_table('run_kernel_windows')
    op.drop_table('run_kernel_ranks')
    op.drop_table('run_kernels')
    op.drop_column('steps', 'hw_flops')

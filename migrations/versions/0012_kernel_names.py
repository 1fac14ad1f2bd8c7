"""kernel hotspots: kernel names stored once per run (run_kernel_names), run_kernels keyed by name id

Demangled kernel names run to hundreds of characters; kept in every (run, rank, kernel) row and its
primary-key index they cost ~1 KB per row. ``run_kernel_names`` holds each run's names once (at most
``analysis.kernels.MAX_NAMES`` plus the per-category "other" rows) with their category;
``run_kernels`` refers to them by id. The folded tables are derived from the ``trace_summary`` events:
they are emptied here and refolded on the next read.

Revision ID: 0012
Revises: 0011
"""
from alembic import op
import sqlalchemy as sa

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def _fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f(f'fk_{table}_run_id_runs'), ondelete='CASCADE')


def upgrade() -> None:
    op.drop_table('run_kernels')
    op.execute("DELETE FROM run_kernel_windows")
    op.execute("DELETE FROM run_kernel_ranks")
    op.create_table(
        'run_kernel_names',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=512), nullable=False),
        sa.Column('category', sa.String(length=16), nullable=False),
        _fk('run_kernel_names'),
        sa.PrimaryKeyConstraint('run_id', 'id', name=op.f('pk_run_kernel_names')),
        sa.UniqueConstraint('run_id', 'name', name=op.f('uq_run_kernel_names_run_id_name')),
    )
    op.create_table(
        'run_kernels',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('name_id', sa.Integer(), nullable=False),
        sa.Column('time_us', sa.Double(), nullable=False),
        sa.Column('launches', sa.BigInteger(), nullable=False),
        sa.Column('windows', sa.Integer(), nullable=False),
        sa.Column('first_us', sa.Double(), nullable=False),
        sa.Column('last_us', sa.Double(), nullable=False),
        _fk('run_kernels'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'name_id', name=op.f('pk_run_kernels')),
    )


def downgrade() -> None:
    op.drop_table('run_kernels')
    op.drop_table('run_kernel_names')
    op.execute("DELETE FROM run_kernel_windows")
    op.execute("DELETE FROM run_kernel_ranks")
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
        _fk('run_kernels'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'name', name=op.f('pk_run_kernels')),
    )

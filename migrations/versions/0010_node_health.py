"""node health: run_node_health, one row per (run, node)

Written when a run's network health is computed (server/analysis/network.py via
server/reports/network.py: the run summary, or ``GET /api/v1/nodes`` catching up on runs without
current rows): the node's ranks in the run, how many of them were stragglers, how many were
network-slow, whether the node was network-slow, and its median busbw / latency ratios, at the
run's ``rank_steps`` / ``status`` then. ``GET /api/v1/nodes`` aggregates these rows per node, so the
node history never reads a step block.

Revision ID: 0010
Revises: 0009
"""
from alembic import op
import sqlalchemy as sa

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'run_node_health',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('node', sa.String(length=256), nullable=False),
        sa.Column('ranks', sa.Integer(), nullable=False),
        sa.Column('straggler_ranks', sa.Integer(), nullable=False),
        sa.Column('slow_ranks', sa.Integer(), nullable=False),
        sa.Column('slow_network', sa.Boolean(), nullable=False),
        sa.Column('busbw_ratio', sa.Double(), nullable=True),
        sa.Column('latency_ratio', sa.Double(), nullable=True),
        sa.Column('rank_steps', sa.BigInteger(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('seen_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('computed_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_node_health_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'node', name=op.f('pk_run_node_health')),
    )
    op.create_index(op.f('ix_run_node_health_node'), 'run_node_health', ['node'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_run_node_health_node'), table_name='run_node_health')
    op.drop_table('run_node_health')

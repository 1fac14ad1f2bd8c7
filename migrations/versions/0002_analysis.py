"""analysis rollups: per-(run, rank) straggler rollups, per-window counts, cached run stats

Revision ID: 0002
Revises: 0001
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rank_rollups',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('steps', sa.Integer(), server_default='0', nullable=False),
    sa.Column('above', sa.Integer(), server_default='0', nullable=False),
    sa.Column('hist', sa.LargeBinary(), nullable=True),
    sa.Column('slowdown', sa.Double(), nullable=True),
    sa.Column('work_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('step_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('data_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('excess_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('data_excess_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('compute_excess_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('other_excess_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('lost_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('slowest_steps', sa.Integer(), server_default='0', nullable=False),
    sa.Column('late_s', sa.Double(), server_default='0', nullable=False),
    sa.Column('late_n', sa.Integer(), server_default='0', nullable=False),
    sa.Column('last_arrivals', sa.Integer(), server_default='0', nullable=False),
    sa.PrimaryKeyConstraint('run_id', 'rank', name=op.f('pk_rank_rollups'))
    )
    op.create_table('rank_windows',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('win', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('steps', sa.Integer(), server_default='0', nullable=False),
    sa.Column('above', sa.Integer(), server_default='0', nullable=False),
    sa.Column('ratio_sum', sa.Double(), server_default='0', nullable=False),
    sa.Column('excess_s', sa.Double(), server_default='0', nullable=False),
    sa.PrimaryKeyConstraint('run_id', 'win', 'rank', name=op.f('pk_rank_windows'))
    )
    # rollup rows are updated in place every compaction pass: leave room for HOT updates
    for t in ('rank_rollups', 'rank_windows'):
        op.execute(f"ALTER TABLE {t} SET (fillfactor = 70)")
    op.create_table('run_stats',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank_steps', sa.BigInteger(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('stats', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
    sa.Column('computed_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_stats_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_run_stats'))
    )


def downgrade() -> None:
    op.drop_table('run_stats')
    op.drop_table('rank_windows')
    op.drop_table('rank_rollups')

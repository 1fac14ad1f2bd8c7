"""projections and their track record (issue: Plan before spending GPUs)

``run_projections``: every projection asked of a run (``GET /api/v1/runs/{id}/projection``), one row per
run and target layout, keeping the first projected figures (made before any run at that layout may have
existed: what the track record checks) and the latest. A per-run table (NOT NULL run_id first in its
primary key): distributed by run_id on Citus. The track record itself is computed at read time from
these rows and the measured runs of the same family, signature and layout (server/reports/projection.py).

Revision ID: 0023
Revises: 0021
"""
from alembic import op
import sqlalchemy as sa

revision = '0023'
down_revision = '0021'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'run_projections',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('world_size', sa.Integer(), nullable=False),
        sa.Column('tp', sa.Integer(), nullable=False),
        sa.Column('pp', sa.Integer(), nullable=False),
        sa.Column('micro_batches', sa.Integer(), nullable=False),  # 0: as the run / not pipelined
        sa.Column('bucket_bytes', sa.BigInteger(), nullable=False),  # 0: as the run
        sa.Column('hold_global_batch', sa.Boolean(), nullable=False),
        sa.Column('owner_key', sa.Text(), nullable=False, server_default=''),
        sa.Column('model_family', sa.String(length=128), nullable=True),
        sa.Column('signature', sa.String(length=64), nullable=False),
        sa.Column('device_type', sa.String(length=64), nullable=True),
        sa.Column('from_world_size', sa.Integer(), nullable=False),
        sa.Column('from_tp', sa.Integer(), nullable=False),
        sa.Column('from_pp', sa.Integer(), nullable=False),
        sa.Column('step_s', sa.Double(), nullable=False),
        sa.Column('mfu', sa.Double(), nullable=True),
        sa.Column('tokens_per_s', sa.Double(), nullable=True),
        sa.Column('error_rel', sa.Double(), nullable=True),
        sa.Column('latest_step_s', sa.Double(), nullable=False),
        sa.Column('requests', sa.Integer(), nullable=False, server_default='1'),
        sa.Column('first_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_projections_run_id_runs'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'world_size', 'tp', 'pp', 'micro_batches', 'bucket_bytes',
                                'hold_global_batch', name=op.f('pk_run_projections')),
    )
    op.create_index('ix_run_projections_family', 'run_projections', ['model_family', 'signature'])


def downgrade() -> None:
    op.drop_index('ix_run_projections_family', table_name='run_projections')
    op.drop_table('run_projections')

"""custom phases: phase_raw (landing queue) and run_phases (per step, summed over ranks)

``run.phase(name)`` names of the job's own (``vision_encoder``, ``loss`` ...) arrive as the wire's
``phases`` section, land in ``phase_raw`` like modality tokens (surrogate key, the compactor keeps
the first copy of each (run, step, rank, phase)) and are folded into ``run_phases``: the seconds
summed over ranks with the bit string of the ranks summed, so the per-step cross-rank mean is
``seconds / bit_count(ranks)``.

Revision ID: 0007
Revises: 0006
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'phase_raw',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('id', sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('phase', sa.String(length=64), nullable=False),
        sa.Column('seconds', sa.Double(), nullable=False),
        sa.Column('received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('run_id', 'id', name=op.f('pk_phase_raw')),
    )
    op.create_table(
        'run_phases',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('phase', sa.String(length=64), nullable=False),
        sa.Column('seconds', sa.Double(), nullable=False),
        sa.Column('ranks', postgresql.BIT(varying=True), nullable=False),
        sa.PrimaryKeyConstraint('run_id', 'step', 'phase', name=op.f('pk_run_phases')),
    )
    op.execute("ALTER TABLE phase_raw SET (autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 1000, "
               "autovacuum_vacuum_insert_scale_factor = 0.0, autovacuum_vacuum_insert_threshold = 10000)")


def downgrade() -> None:
    op.drop_table('run_phases')
    op.drop_table('phase_raw')

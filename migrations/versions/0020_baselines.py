"""baselines: a pinned regression baseline per owner namespace, family and config signature

``fleetscope baseline pin RUN`` (``POST /api/v1/baselines``) records the run every later run of the same
namespace, family and signature is checked against (with the runs that passed after it); without a pin
the baseline is the runs that passed. A regression that is never fixed never becomes the baseline.

Revision ID: 0020
Revises: 0019
"""
from alembic import op
import sqlalchemy as sa

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'baselines',
        sa.Column('owner_key', sa.Text(), nullable=False, server_default=''),
        sa.Column('model_family', sa.String(length=128), nullable=False),
        sa.Column('config_signature', sa.String(length=64), nullable=False),
        # nullable: a reference table on Citus (a NOT NULL run_id would make it a per-run table)
        sa.Column('run_id', sa.Integer(), nullable=True),
        sa.Column('pinned_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('pinned_by', sa.String(length=128), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_baselines_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('owner_key', 'model_family', 'config_signature', name=op.f('pk_baselines')),
    )


def downgrade() -> None:
    op.drop_table('baselines')
